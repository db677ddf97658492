"""torch's programmatic API shapes, from ``elastic`` itself, with real worker processes:
``elastic_launch``/``LaunchConfig`` (gloo on CPU), ``ChildFailedError``, a bare
``LocalElasticAgent`` (seed 002's example), ``RendezvousParameters`` with torch's
keywords, and in-process backend registration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from elastic import (
    ChildFailedError,
    LaunchConfig,
    LocalElasticAgent,
    RendezvousParameters,
    WorkerSpec,
    elastic_launch,
    get_rendezvous_handler,
    register_rendezvous_handler,
)
from elastic.api import launch_config_for
from elastic.core.rendezvous.local import LocalRendezvousHandler
from elastic.core.rendezvous.registry import BACKENDS
from elastic.harness.commands import REPO, cli_env


def one_node(**kwargs: Any) -> LaunchConfig:
    """torch's one-node job on a free port."""
    kwargs.setdefault("nproc_per_node", 2)
    kwargs.setdefault("monitor_interval", 0.05)
    return LaunchConfig(
        min_nodes=1, max_nodes=1, rdzv_backend="c10d", rdzv_endpoint="localhost:0", **kwargs
    )


# Worker functions live at module level: spawned workers import them by name.
def gloo_all_reduce(scale: int) -> tuple[int, int]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    dist.destroy_process_group()
    return int(total.item()) * scale, int(os.environ["RANK"])


def fail_on_rank_one() -> str:
    if os.environ["RANK"] == "1":
        raise ValueError("loss is nan")
    return "ok"


def train_loop() -> int:  # seed 002's entrypoint
    return int(os.environ["RANK"]) * 10 + int(os.environ["WORLD_SIZE"])


def test_import_elastic_is_cheap_and_exports_the_api() -> None:
    code = (
        "import sys, elastic\n"
        "names = ['LaunchConfig', 'elastic_launch', 'launch_agent', 'ChildFailedError',\n"
        "         'WorkerSpec', 'LocalElasticAgent', 'RendezvousParameters',\n"
        "         'register_rendezvous_handler', 'get_rendezvous_handler']\n"
        "assert all(callable(getattr(elastic, n)) for n in names)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=cli_env(), timeout=60)


def test_elastic_launch_runs_a_gloo_job_and_returns_every_rank() -> None:
    results = elastic_launch(one_node(run_id="gloo"), gloo_all_reduce)(10)
    assert results == {0: (30, 0), 1: (30, 1)}  # 1 + 2 summed over both ranks


def test_a_failure_raises_child_failed_error_with_the_root_cause(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    config = one_node(plugin_options={"error_summary": str(summary)})
    with pytest.raises(ChildFailedError) as raised:
        elastic_launch(config, fail_on_rank_one)()
    err = raised.value
    rank, root = err.get_first_failure()
    assert rank == 1 and set(err.failures) == {1}
    assert root.message == "ValueError: loss is nan" and err.exit_code == 1
    assert str(err).startswith("fail_on_rank_one failed: root cause rank 1 (local rank 1")
    assert "exited with code 1 at " in str(err) and str(err).endswith(": ValueError: loss is nan")
    # A plugin option set from Python reached its plugin (the errors plugin's summary).
    assert json.loads(summary.read_text())["root_cause"]["rank"] == 1


def test_scripts_and_programs_return_none_per_rank(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import os, sys\n"
        "open(os.path.join(sys.argv[1], 'rank' + os.environ['RANK']), 'w').write(sys.argv[2])\n"
    )
    assert elastic_launch(one_node(), str(script))(tmp_path, "from-script") == {0: None, 1: None}
    assert (tmp_path / "rank1").read_text() == "from-script"
    # A program and its arguments, as torch takes them.
    program = elastic_launch(one_node(nproc_per_node=1), sys.executable)
    assert program("-u", str(script), str(tmp_path), "from-program") == {0: None}
    assert (tmp_path / "rank0").read_text() == "from-program"


def test_a_failing_script_names_its_exit_code(tmp_path: Path) -> None:
    script = tmp_path / "exit3.py"
    script.write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(ChildFailedError) as raised:
        elastic_launch(one_node(nproc_per_node=1), str(script))()
    assert raised.value.exit_code == 3 and "exited with code 3" in str(raised.value)


def test_torch_spellings_in_launch_config() -> None:
    config = launch_config_for(
        LaunchConfig(
            min_nodes=1,
            max_nodes=2,
            nproc_per_node=1,
            rdzv_backend="c10d",
            rdzv_endpoint="h:29400",
            rdzv_timeout=600,
            signals_to_handle="SIGTERM,SIGUSR1",  # type: ignore[arg-type]
            redirects=3,
        )
    )
    assert config.rdzv_configs == {"join_timeout": "600"}
    assert config.signals_to_handle == ("SIGTERM", "SIGUSR1") and not config.standalone
    with pytest.raises(ValueError, match="port 0 .* is for one-node jobs, but max_nodes=2"):
        launch_config_for(LaunchConfig(1, 2, 1, rdzv_backend="c10d", rdzv_endpoint="h:0"))


def test_a_setting_out_of_range_is_a_value_error_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"^max_restarts: -1 is negative; expected 0 or more$"):
        LaunchConfig(1, 1, 1, max_restarts=-1)
    assert LaunchConfig(1, 1, 1, preemption_signal="usr1").preemption_signal == "SIGUSR1"
    config = one_node()
    config.monitor_interval = 0  # changed after it was made: checked again at launch
    with pytest.raises(ValueError, match="^monitor_interval: expected a positive number"):
        elastic_launch(config, train_loop)()


def test_unknown_plugin_option_is_named() -> None:
    with pytest.raises(ValueError, match=r"unknown plugin option\(s\) eror_summary; known: "):
        elastic_launch(one_node(plugin_options={"eror_summary": "x"}), train_loop)()


def test_seed_002_example_runs_as_written() -> None:
    result = LocalElasticAgent(
        WorkerSpec(role="trainer", local_world_size=4, entrypoint=train_loop)
    ).run()
    assert result.return_values == {0: 4, 1: 14, 2: 24, 3: 34}
    assert result.exit_code == 0


def test_rendezvous_parameters_take_torch_keywords() -> None:
    params = RendezvousParameters(
        "c10d", "h:29400", "job", 1, 2, join_timeout="600", is_host=True, read_timeout=5
    )
    assert params.config == {"join_timeout": "600", "is_host": True, "read_timeout": 5}
    assert params.get("join_timeout") == "600" and params.get_as_int("join_timeout") == 600
    assert params.get_as_bool("is_host") is True and params.get_as_float("read_timeout") == 5.0
    assert params.get("missing", "d") == "d" and params.local_addr is None
    # The project's config= dict and fields still work, and keywords add to it.
    ours = RendezvousParameters(
        backend="c10d",
        endpoint="h",
        run_id="j",
        min_nodes=1,
        max_nodes=1,
        local_addr="10.0.0.1",
        config={"a": "1"},
        read_only=True,
        b="2",
    )
    assert ours.config == {"a": "1", "b": "2"} and ours.read_only and ours.local_addr == "10.0.0.1"
    with pytest.raises(ValueError, match=r"max_nodes \(1\) must be >= min_nodes \(2\)"):
        RendezvousParameters("c10d", "h", "j", 2, 1, join_timeout="1")
    with pytest.raises(ValueError, match="is not an integer"):
        RendezvousParameters("c10d", "h", "j", 1, 1, join_timeout=[1]).get_as_int("join_timeout")


def test_a_backend_registered_in_process_is_used_by_elastic_launch() -> None:
    made: list[RendezvousParameters] = []

    def create_handler(params: RendezvousParameters) -> LocalRendezvousHandler:
        made.append(params)
        return LocalRendezvousHandler(params.run_id)

    register_rendezvous_handler("test-inprocess", create_handler)
    try:
        handler = get_rendezvous_handler(RendezvousParameters("test-inprocess", "", "j", 1, 1))
        assert handler.get_run_id() == "j"
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=2,
            run_id="reg",
            rdzv_backend="test-inprocess",
            rdzv_configs={"anything": "x"},
            monitor_interval=0.05,
        )
        assert elastic_launch(config, train_loop)() == {0: 2, 1: 12}
        assert made[-1].run_id == "reg" and made[-1].config == {"anything": "x"}
        with pytest.raises(ValueError, match="already registered"):
            register_rendezvous_handler("test-inprocess", lambda p: handler)
    finally:
        BACKENDS.unregister("test-inprocess")


def test_the_readme_example_runs_as_written(tmp_path: Path) -> None:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Using it from Python") :]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "example.py").write_text(code)
    result = subprocess.run(
        [sys.executable, "example.py"],
        cwd=tmp_path,
        env=cli_env({"OMP_NUM_THREADS": "1"}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "{0: 30.0, 1: 30.0}"
