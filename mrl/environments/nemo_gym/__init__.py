"""NeMo Gym's resource servers as environments of a run (`kind: nemo_gym`).

    make gym-venv           .venv-gym: Python 3.12 and nemo-gym at requirements/gym.lock's versions, apart from
                            mrl's packages (mrl/data/nemo_gym.py finds it)
    environment.py          the environment of a run: its server started (process.py) or found at a url
    process.py + launch.py  one server as a process of NeMo Gym's Python, without NeMo Gym's Ray or head server
    client.py               mrl's resource-server client in NeMo Gym's formats (seed_session with the row, a session
                            cookie, tools with the model's arguments, verify with a Responses object)

Rows: NeMo Gym's jsonl as they are (`responses_create_params` + the fields its /verify reads), e.g. the example rows a
server ships, `nemo-gym:workplace_assistant/example.jsonl` (mrl/data/nemo_gym.py).
"""
