"""``elastic run`` under ``srun`` (issue 26): SLURM hostlists expanded in pure Python, an
srun step told from an salloc shell, SLURM's values filling only the options not given, and
the CLI with a fake step's environment through ``--dry-run``. The two-host run is in
``tests/test_slurm_multihost.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
from elastic.cli.slurm import (
    SlurmError,
    SlurmStep,
    detect,
    expand_hostlist,
    port_for_job,
    slurm_values,
)
from elastic.harness.commands import run_elastic


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("node7", ["node7"]),
        ("a,b,c", ["a", "b", "c"]),
        ("gpu[01-04,07],cpu3", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu3"]),
        ("node[1-3]-ib", ["node1-ib", "node2-ib", "node3-ib"]),
        ("a[01-02]b[1-2]", ["a01b1", "a01b2", "a02b1", "a02b2"]),
        ("n[08-10]", ["n08", "n09", "n10"]),  # padded to the first number's width
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[001-002,5]", ["n001", "n002", "n5"]),
        ("r[1-2]x,s[3],t", ["r1x", "r2x", "s3", "t"]),
        ("[1-2]", ["1", "2"]),
        ("node0-12c0,node1-12c0", ["node0-12c0", "node1-12c0"]),
        (" host-a.example.org ", ["host-a.example.org"]),
    ],
)
def test_hostlists_expand_as_scontrol_does(hostlist: str, hosts: list[str]) -> None:
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize(
    ("hostlist", "expected"),
    [
        ("", "is not a SLURM hostlist"),
        ("gpu[01-", "is not a SLURM hostlist"),
        ("gpu01-]", "is not a SLURM hostlist"),
        ("a,,b", "is not a SLURM hostlist"),
        ("a,", "is not a SLURM hostlist"),
        ("a[[1]]", "is not a SLURM hostlist"),
        ("n[a-b]", "[a-b] is not a list of numbers and ranges"),
        ("n[1-3:2]", "is not a list of numbers and ranges"),
        ("n[]", "is not a list of numbers and ranges"),
        ("n[5-2]", "range 5-2 runs backwards"),
    ],
)
def test_bad_hostlists_name_what_is_wrong(hostlist: str, expected: str) -> None:
    with pytest.raises(SlurmError) as info:
        expand_hostlist(hostlist)
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


def srun_env(node: int = 1, **extra: str) -> dict[str, str]:
    """What srun -N2 --ntasks-per-node=1 gives task ``node`` (the variables we read)."""
    env = {
        "SLURM_JOB_ID": "123456",
        "SLURM_JOB_NUM_NODES": "4",  # the allocation; the step has 2
        "SLURM_JOB_NODELIST": "gpu[01-04]",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(node),
        "SLURM_NTASKS": "2",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": str(node),
        "SLURM_STEP_NODELIST": "gpu[03-04]",
    }
    env.update(extra)
    return env


def test_an_srun_step_is_detected() -> None:
    step = detect(srun_env())
    assert step is not None
    assert (step.job_id, step.step_id, step.nnodes, step.node_id) == ("123456", "0", 2, 1)
    assert step.first_host == "gpu03"  # the step's nodes, not the allocation's
    assert step.port == 15000 + 3456
    assert step.tasks_per_node() == 1


def test_the_step_node_count_comes_first_then_the_job_nodelist() -> None:
    env = srun_env(SLURM_STEP_NUM_NODES="3")
    del env["SLURM_STEP_NODELIST"]
    step = detect(env)
    assert step is not None and step.nnodes == 3 and step.first_host == "gpu01"
    assert (step.nnodes_var, step.nodelist_var) == ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NODELIST")


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"SLURM_JOB_ID": "5", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "a[1-2]"},  # salloc
        {"SLURM_JOB_ID": "5", "SLURM_NODEID": "0", "SLURM_PROCID": "0"},  # batch script
        {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NODEID": "0"},  # no job
    ],
)
def test_outside_an_srun_step_nothing_is_detected(env: dict[str, str]) -> None:
    assert detect(env) is None


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"SLURM_NNODES": "two"}, "SLURM_NNODES='two' is not a number"),
        ({"SLURM_NODEID": "2"}, "SLURM_NODEID=2 is not a node of SLURM_NNODES=2"),
        ({"SLURM_JOB_ID": "12_3"}, "SLURM_JOB_ID='12_3' is not a SLURM job id"),
        ({"SLURM_STEP_NODELIST": "gpu[1"}, "'gpu[1' is not a SLURM hostlist"),
    ],
)
def test_a_broken_step_is_one_line(change: dict[str, str], expected: str) -> None:
    with pytest.raises(SlurmError) as info:
        detect(srun_env(**change))
    assert expected in str(info.value)


def test_a_step_without_its_node_variables_says_which() -> None:
    env = srun_env()
    for name in ("SLURM_NODEID", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        del env[name]
    with pytest.raises(SlurmError, match="without SLURM_NNODES, SLURM_NODEID"):
        detect(env)


def test_the_port_follows_lightning() -> None:
    assert port_for_job("7") == 15007
    assert port_for_job("98765432") == 15000 + 5432


DEFAULTS = {
    "nnodes": "1:1",
    "node_rank": 0,
    "rdzv_backend": "static",
    "rdzv_endpoint": "",
    "rdzv_id": "none",
    "master_addr": "127.0.0.1",
    "master_port": None,
    "standalone": False,
}


def step(**kwargs: object) -> SlurmStep:
    found = detect(srun_env())
    assert found is not None
    return SlurmStep(**{**found.__dict__, **kwargs})


def values(given: dict[str, object], the_step: SlurmStep | None = None) -> dict[str, object]:
    taken = slurm_values(the_step or step(), {**DEFAULTS, **given}, set(given))
    return {dest: t.value for dest, t in taken.items()}


def test_nothing_given_makes_one_c10d_job_across_the_step() -> None:
    assert values({}) == {
        "nnodes": "2",
        "node_rank": 1,
        "rdzv_backend": "c10d",
        "rdzv_endpoint": "gpu03:18456",
        "rdzv_id": "123456.0",
    }


def test_what_is_given_wins() -> None:
    assert values({"nnodes": "1:2", "rdzv_id": "mine", "master_port": 2222}) == {
        "node_rank": 1,
        "rdzv_backend": "c10d",
        "rdzv_endpoint": "gpu03:2222",
    }
    assert values({"rdzv_backend": "c10d", "rdzv_endpoint": "h:1", "node_rank": 0}) == {
        "nnodes": "2",
        "rdzv_id": "123456.0",
    }


def test_static_gets_the_master_address_and_port() -> None:
    assert values({"rdzv_backend": "static"}) == {
        "nnodes": "2",
        "node_rank": 1,
        "master_addr": "gpu03",
        "master_port": 18456,
        "rdzv_id": "123456.0",
    }


def test_another_backend_keeps_its_own_endpoint() -> None:
    got = values({"rdzv_backend": "etcd-v3", "rdzv_endpoint": "etcd:2379"})
    assert got == {"nnodes": "2", "node_rank": 1, "rdzv_id": "123456.0"}


@pytest.mark.parametrize("given", [{"standalone": True}, {"nnodes": "1"}, {"nnodes": "1:1"}])
def test_a_one_node_job_asked_for_ignores_slurm(given: dict[str, object]) -> None:
    assert values(given) == {}


@pytest.mark.parametrize(
    "change", [{"ntasks_per_node": 2}, {"ntasks": 4}, {"ntasks": 3, "ntasks_per_node": 1}]
)
def test_several_tasks_per_node_are_refused(change: dict[str, int]) -> None:
    with pytest.raises(SlurmError, match="use srun --ntasks-per-node=1"):
        values({}, step(**change))


def test_several_tasks_per_node_pass_when_nothing_is_taken() -> None:
    given = {
        "nnodes": "2",
        "node_rank": 1,
        "rdzv_backend": "c10d",
        "rdzv_endpoint": "h:1",
        "rdzv_id": "x",
    }
    assert values(given, step(ntasks=4)) == {}


# --- the CLI, with a fake step's environment ---


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("raise SystemExit('a dry run must not start workers')\n")
    return path


def test_dry_run_shows_the_launch_slurm_makes(script: Path) -> None:
    result = run_elastic("run", "--dry-run", "--nproc-per-node=2", str(script), env=srun_env())
    assert result.returncode == 0, result.stderr
    rows = dict(
        (key.strip(), value.strip())
        for key, _, value in (line.partition(":") for line in result.stdout.splitlines()[1:])
    )
    assert rows["nodes"] == "2  (from SLURM_NNODES)"
    assert rows["node rank"] == "1  (from SLURM_NODEID)"
    assert rows["backend"].startswith("c10d  (from SLURM")
    assert rows["endpoint"] == (
        "gpu03:18456  (from SLURM_STEP_NODELIST's first host, port from SLURM_JOB_ID)"
    )
    assert rows["run id"] == "123456.0  (from SLURM_JOB_ID, SLURM_STEP_ID)"
    assert rows["nproc per node"] == "2"
    assert result.stdout.startswith("elastic run --dry-run: this launch (nothing started)\n")
    assert "Traceback" not in result.stderr


def test_dry_run_flags_and_pet_variables_win(script: Path) -> None:
    env = srun_env(PET_RDZV_ID="job-from-pet")
    result = run_elastic("run", "--dry-run", "--nnodes=1:2", str(script), env=env)
    assert result.returncode == 0, result.stderr
    assert "  nodes:          1:2\n" in result.stdout
    assert "  run id:         job-from-pet\n" in result.stdout
    assert "  node rank:      1  (from SLURM_NODEID)\n" in result.stdout


def test_dry_run_outside_slurm_is_the_plain_launch(script: Path) -> None:
    # an salloc shell: a job, no step
    env = {"SLURM_JOB_ID": "9", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "a[1-2]"}
    result = run_elastic("run", "--dry-run", str(script), env=env)
    assert result.returncode == 0, result.stderr
    assert "from" not in result.stdout
    assert "  backend:        standalone\n" in result.stdout


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (srun_env(SLURM_NTASKS_PER_NODE="2", SLURM_NTASKS="4"), "use srun --ntasks-per-node=1"),
        (srun_env(SLURM_NTASKS="4"), "srun runs 2 tasks per node"),
        (srun_env(SLURM_STEP_NODELIST="gpu[03-"), "is not a SLURM hostlist"),
    ],
)
def test_bad_slurm_input_is_one_line_and_exit_2(
    env: dict[str, str], expected: str, script: Path
) -> None:
    result = run_elastic("run", "--dry-run", str(script), env=env, timeout=30)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("elastic run: error:") and expected in line


def test_a_real_run_says_what_it_took_from_slurm_unless_quiet(tmp_path: Path) -> None:
    show = tmp_path / "show.py"
    show.write_text(
        "import os\n"
        # One write of one line: both workers write to the agent's stdout, where print's
        # pieces from two workers can interleave (its arguments are separate writes on
        # an unbuffered stream).
        "line = f\"WS {os.environ['WORLD_SIZE']} ID {os.environ['TORCHELASTIC_RUN_ID']}\\n\"\n"
        "os.write(1, line.encode())\n"
    )
    env = srun_env(
        node=0,
        SLURM_NNODES="1",
        SLURM_NTASKS="1",
        SLURM_STEP_NODELIST="localhost",
        OMP_NUM_THREADS="1",
    )
    result = run_elastic("run", "--nproc-per-node=2", str(show), env=env)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines()[0] == (
        "elastic: from SLURM job 123456 step 0: --nnodes=1 --node-rank=0 --rdzv-backend=c10d "
        "--rdzv-endpoint=localhost:18456 --rdzv-id=123456.0"
    )
    assert result.stdout.count("WS 2 ID 123456.0") == 2
    quiet = run_elastic("run", "--quiet", str(show), env=env)
    assert quiet.returncode == 0, quiet.stderr
    assert "SLURM" not in quiet.stderr


def test_each_step_and_each_requeued_run_is_a_job_of_its_own() -> None:
    first = detect(srun_env(SLURM_STEP_ID="3"))
    requeued = detect(srun_env(SLURM_STEP_ID="3", SLURM_RESTART_COUNT="2"))
    assert first is not None and requeued is not None
    assert (first.run_id, first.run_id_source) == ("123456.3", "SLURM_JOB_ID, SLURM_STEP_ID")
    assert requeued.run_id == "123456.3.r2"
    assert requeued.run_id_source == "SLURM_JOB_ID, SLURM_STEP_ID and SLURM_RESTART_COUNT"


# A batch script: a job, no step (SLURM_NODEID and SLURM_PROCID are set there too).
BATCH_ENV = {
    "SLURM_JOB_ID": "77",
    "SLURM_NNODES": "4",
    "SLURM_NODEID": "0",
    "SLURM_PROCID": "0",
    "SLURM_JOB_NODELIST": "gpu[01-04]",
}


@pytest.mark.parametrize("nnodes", ["4", "2:4"])
def test_several_nodes_outside_a_step_is_one_line_naming_srun(script: Path, nnodes: str) -> None:
    result = run_elastic("run", "--dry-run", f"--nnodes={nnodes}", str(script), env=BATCH_ENV)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    wanted = int(nnodes.split(":")[0])
    assert line == (
        f"elastic run: error: elastic run --nnodes={nnodes} in SLURM job 77 but not in an srun "
        "step (a batch script or salloc shell) is one agent on one node and would wait "
        f"forever for {wanted - 1} more; start one agent per node instead: srun -N{wanted} "
        "--ntasks-per-node=1 elastic run ... (SLURM fills --nnodes and the rendezvous)"
    )


@pytest.mark.parametrize(
    "flags",
    [["--nnodes=1:4"], ["--nnodes=4", "--rdzv-endpoint=head:29400"], ["--standalone"]],
)
def test_outside_a_step_a_launch_that_can_complete_runs(script: Path, flags: list[str]) -> None:
    result = run_elastic("run", "--dry-run", *flags, str(script), env=BATCH_ENV)
    assert result.returncode == 0, result.stderr


def test_an_interactive_steps_shell_of_several_nodes_is_refused() -> None:
    env = srun_env(SLURM_PTY_PORT="40301")
    interactive = detect(env, stdin_tty=True)
    assert interactive is not None and interactive.interactive
    with pytest.raises(SlurmError, match=r"interactive step \(srun --pty\) of 2 nodes"):
        slurm_values(interactive, DEFAULTS, set())
    # A step started from that shell inherits SLURM_PTY_PORT, not the terminal.
    nested = detect(env, stdin_tty=False)
    assert nested is not None and not nested.interactive
    assert slurm_values(nested, DEFAULTS, set())["nnodes"].value == "2"
    # One node, or a one-node job asked for, is fine from the terminal.
    one = detect(srun_env(node=0, SLURM_PTY_PORT="1", SLURM_NNODES="1", SLURM_NTASKS="1"), True)
    assert one is not None and slurm_values(one, DEFAULTS, set())["nnodes"].value == "1"
    assert slurm_values(interactive, {**DEFAULTS, "standalone": True}, {"standalone"}) == {}
