"""The verifier functions and the in-process arithmetic environment (the Ray pool is in tests/functional)."""

import pytest

from mrl.config.schema import EnvConfig
from mrl.environments.arith import ArithEnvironment, arith_reward
from mrl.environments.base import last_response
from mrl.environments.math import boxed_gold, math_verify_reward, math_verify_verdict, readable
from mrl.environments.registry import build_environment


@pytest.mark.parametrize("response, gold, expected", [
    ("So the answer is $\\boxed{0.5}$.", "\\frac{1}{2}", 1.0),         # decimal vs LaTeX fraction
    ("Thus \\boxed{\\dfrac{1}{2}}", "1/2", 1.0),                        # \dfrac vs plain fraction
    ("We get \\boxed{\\frac{3}{4}}", "\\frac{1}{2}", 0.0),              # wrong fraction
    ("The final answer is \\boxed{42}", "42", 1.0),                     # integer
    ("The final answer is \\boxed{41}", "42", 0.0),
    ("\\boxed{2^{1/2}}", "\\sqrt{2}", 1.0),                             # symbolic equality
    ("\\boxed{1+x^2}", "x^2+1", 1.0),                                   # expression, reordered
    ("the answer is \\boxed{(1, 2)}", "\\boxed{(1,2)}", 1.0),           # gold already boxed
    ("I am not sure.", "7", 0.0),                                       # no answer at all
])
def test_math_verify_on_real_answer_forms(response, gold, expected):
    assert math_verify_reward(response, gold) == expected


# What real models write (SmolLM2, GSM8K-trained models): the answer math-verify reads, and its verdict, by hand.
@pytest.mark.parametrize("response, gold, read, expected", [
    ("She makes 9 * 2 = 18 dollars. The answer is 18.", "18", "18", 1.0),
    ("16 - 3 - 4 = 9\n9 * 2 = 18\n#### 18", "18", "18", 1.0),                  # GSM8K's own format
    ("So the answer is 1,000 dollars.", "1000", "1000", 1.0),                      # thousands separator, unit
    ("The answer is $1,000.", "1,000", "1000", 1.0),                               # currency, gold with a comma
    ("The total cost is \\$18.00.", "18", "18.00", 1.0),                         # escaped dollar (see readable)
    ("It rose by 18%", "18", "18", 1.0),                                           # percent equals the number
    ("The answer is: 40", "260", "40", 0.0),
    ("The final answer is 800,000 - 100,000 = $70,000.", "70000", "800000", 0.0),  # math-verify's mis-read
    ("#### 18\n\nQuestion: Tom has 5 apples", "18", "5", 0.0),                   # rambling on: the last number
    ("The load time is 100%. The load time is", "160", "100", 0.0),
    ("I do not know.", "7", None, 0.0),
])
def test_what_math_verify_reads_in_real_model_answers(response, gold, read, expected):
    from math_verify import parse, verify

    assert math_verify_verdict(response, gold) == (expected, read)
    # The verdict is math-verify's own, on the readable response and the boxed gold.
    assert expected == float(verify(parse(boxed_gold(gold)), parse(readable(response))))


def test_gold_is_boxed_once():
    assert boxed_gold("\\frac{1}{2}") == "\\boxed{\\frac{1}{2}}"
    assert boxed_gold("\\boxed{3}") == "\\boxed{3}"


def test_arith_reward_is_exact_match_of_the_first_integer():
    assert arith_reward("42", "42") == 1.0
    assert arith_reward("042 7", "42") == 1.0
    assert arith_reward("41", "42") == 0.0
    assert arith_reward("4 2", "42") == 0.0
    assert arith_reward("", "42") == 0.0
    with pytest.raises(ValueError, match="the gold answer 'seven' is not an integer"):  # whatever the response says
        arith_reward("no number here", "seven")


def conversation(response):
    return [{"role": "user", "content": "37+05="}, {"role": "assistant", "content": response}]


def test_arith_environment_scores_truncated_samples_zero_and_counts_bad_gold():
    env = build_environment(EnvConfig(kind="arith"))
    assert isinstance(env, ArithEnvironment)
    logs = [conversation("42"), conversation("42"), conversation("40"), conversation("5")]
    meta = [{"answer": "42", "finished": True}, {"answer": "42", "finished": False},
            {"answer": "42", "finished": True}, {"answer": "five", "finished": True}]
    out = env.step(logs, meta)
    assert out.rewards.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert out.done.tolist() == [True] * 4
    assert out.num_errors == 1 and "five" in out.error_messages[0]
    assert out.metadata[3]["reward_error"] and "reward_error" not in out.metadata[0]
    with pytest.raises(KeyError, match="finished"):
        env.step([conversation("42")], [{"answer": "42"}])


def test_last_response_is_the_last_assistant_message():
    log = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
           {"role": "environment", "content": "c"}]
    assert last_response(log) == "b"
    assert last_response([{"role": "user", "content": "a"}]) == ""


# Arithmetic left undone is not an answer (restates_without_value): math-verify alone scores all of these 1.0.
@pytest.mark.parametrize("response, gold, read, expected", [
    ("3 * 4 =", "12", "3 * 4", 0.0),                 # what GRPO on SmolLM2 learned when this scored 1
    ("It is 3 * 4.", "12", "3 * 4.", 0.0),
    ("\\boxed{3 \\cdot 4}", "12", "3 \\cdot 4", 0.0),
    ("$3\\times 4$", "12", "3\\times 4", 0.0),
    ("2^3", "8", "2^3", 0.0),
    ("10 - -2", "12", "10 - -2", 0.0),
    ("3 * 4 = 12", "12", "12", 1.0),                 # the work shown, then the value
    ("-1", "-1", "-1", 1.0),                         # a sign is not an operation
    ("1/2", "0.5", "1/2", 1.0),                      # a fraction is a value
    ("The answer is 1,000.", "1,000", "1000", 1.0),
])
def test_arithmetic_left_undone_scores_zero_where_the_gold_is_a_number(response, gold, read, expected):
    from math_verify import parse, verify

    assert math_verify_verdict(response, gold) == (expected, read)
    assert verify(parse(boxed_gold(gold)), parse(readable(response)))  # math-verify alone: right in every case
