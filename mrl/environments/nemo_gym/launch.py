"""Serve one NeMo Gym resource server over HTTP: run by NeMo Gym's own Python (its virtual environment), never by mrl's.

    python launch.py <server> <name> <port> <config json> <parent pid>

<server> is a folder of NeMo Gym's `resources_servers` package; its app.py's resource-server class is found by type.
Its config is the server's own configs/<server>.yaml block (resources_servers.<server>), then `name`, the address,
and <config json> over it. What `SimpleServer.run_webserver` does (nemo-gym 0.4.0, nemo_gym/server_utils.py), less
what mrl must not have: it calls `ray.init()` with no address, which joins whatever Ray cluster this machine
last started (mrl's own, or another job's), and it needs NeMo Gym's head server. So: the server object, its routes,
its liveness route (GET /) and its exception middleware, served by uvicorn, and no Ray, head server or profiling.
The process ends when its parent does (a controller killed with SIGKILL leaves no server behind).

This file imports nothing of mrl: it runs under Python >= 3.12 with nemo-gym's packages only.
"""

import importlib
import inspect
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any


def main() -> None:
    server_name, name, port, overrides, parent = sys.argv[1:6]
    _exit_with_parent(int(parent))
    import uvicorn
    import yaml
    from nemo_gym.base_resources_server import SimpleResourcesServer
    from nemo_gym.config_types import BaseServerConfig
    from nemo_gym.server_utils import ServerClient
    from omegaconf import OmegaConf

    module = importlib.import_module(f"resources_servers.{server_name}.app")
    classes = [
        c
        for _, c in inspect.getmembers(module, inspect.isclass)
        if issubclass(c, SimpleResourcesServer) and c.__module__ == module.__name__
    ]
    if len(classes) != 1:
        sys.exit(f"resources_servers.{server_name}.app defines {len(classes)} resource-server classes, not one")
    cls: Any = classes[0]
    config: dict[str, Any] = {"entrypoint": "app.py", "domain": "other"}
    config_file = Path(str(module.__file__)).parent / "configs" / f"{server_name}.yaml"
    if config_file.is_file():
        shipped = yaml.safe_load(config_file.read_text()) or {}
        for block in shipped.values():
            config.update(((block or {}).get("resources_servers") or {}).get(server_name) or {})
    config.update(json.loads(overrides))
    config.update({"host": "127.0.0.1", "port": int(port), "name": name})
    server_config = cls.model_fields["config"].annotation.model_validate(config)
    client = ServerClient(
        head_server_config=BaseServerConfig(host="127.0.0.1", port=1), global_config_dict=OmegaConf.create({})
    )
    server = cls(config=server_config, server_client=client)
    app = server.setup_webserver()
    server.setup_liveness(app)
    server.setup_exception_middleware(app)
    print(f"serving {cls.__name__} ({server_name}) as {name!r} on 127.0.0.1:{port}", flush=True)
    uvicorn.run(app, host="127.0.0.1", port=int(port), log_level="warning")


def _exit_with_parent(parent: int) -> None:
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


if __name__ == "__main__":
    main()
