"""Every driver's container, built by the driver and created by the adapter, runs and becomes ready.

The image is that engine's stand-in (tests/support/standin_server.py as ENTRYPOINT, STANDIN_ENGINE baked
in), so the command line the driver builds is what the process receives, as with the real engine.
"""

import time
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.meridian.node.plugins.module_utils.docker.engine import DockerEngine
from ansible_collections.meridian.node.plugins.module_utils.engine_rules import DRIVERS
from ansible_collections.meridian.node.plugins.module_utils.engines.drivers import get_driver
from ansible_collections.meridian.node.plugins.module_utils.engines.probes import (
    container_settings,
    http_get,
    probe_readiness,
    read_in_flight,
)
from ansible_collections.meridian.node.plugins.module_utils.engines.spec import parse_engine_spec
from ansible_collections.meridian.node.tests.support.engine_harness import free_port
from ansible_collections.meridian.node.tests.support.standin_image import LocalImage, ensure_engine_image

SERVER = Path(__file__).resolve().parents[2] / "support" / "standin_server.py"
BIND = "127.0.0.1"


@pytest.fixture
def engine(docker_client: Any) -> DockerEngine:
    return DockerEngine.from_env()


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    (directory / "tiny-q4.gguf").write_bytes(b"GGUF")
    return directory


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.parametrize("driver_name", DRIVERS)
def test_driver_container_starts_and_becomes_ready(
    docker_client: Any,
    standin_base_image: LocalImage,
    engine: DockerEngine,
    prefix: str,
    model_dir: Path,
    driver_name: str,
) -> None:
    image = ensure_engine_image(docker_client, standin_base_image, SERVER, engine=driver_name)
    env = {"STANDIN_LOAD_SECONDS": "1"}
    if driver_name == "ollama":
        # Ollama names no model on its command line: it serves what its models directory holds, which
        # for the stand-in is this variable.
        env["STANDIN_MODEL"] = "tiny-chat"
    # The generic driver knows nothing of its server's flags: the spec's args are its whole command line.
    args = ["--served-model-name", "tiny-chat"] if driver_name == "openai" else []
    spec = parse_engine_spec(
        {
            "name": f"{prefix}-{driver_name}",
            "driver": driver_name,
            "image": image.pinned,
            "model": {"artifact": "tiny"},
            "served_model_name": "tiny-chat",
            "port": free_port(),
            "env": env,
            "args": args,
        }
    )
    driver = get_driver(driver_name)
    launch = driver.container_settings(spec, model_dir=str(model_dir), model_files=["config.json", "tiny-q4.gguf"])
    container = engine.create(container_settings(name=spec.name, driver=driver_name, launch=launch, bind_address=BIND))
    engine.start(container)

    verdicts = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        verdict = probe_readiness(driver, BIND, spec.port)
        verdicts.append(verdict)
        if verdict.ready:
            break
        time.sleep(0.2)
    assert verdicts[-1].ready, f"never ready; last verdicts {verdicts[-3:]}; logs:\n{engine.logs_tail(container)}"
    assert all(v.loading for v in verdicts[:-1]), f"not ready for a reason other than loading: {verdicts}"

    models = http_get(BIND, spec.port, driver.facts.model_list_path)
    assert models.status == 200
    assert driver.served_name(spec) in models.body

    gauges = read_in_flight(driver, BIND, spec.port)
    if driver.facts.has_metrics:
        assert gauges is not None and gauges.total == 0, gauges
    else:
        assert gauges is None

    engine.stop(container, timeout_s=launch.stop_timeout_s)
    assert engine.container(container.id).state == "exited"
    engine.remove(container)
    assert engine.find(spec.name) is None
