"""``python -m sandbox_sim fanout``: campaign seeds as Ray tasks (issue 19).

On a small local Ray cluster (2 CPUs) when the ``sandbox[cluster]`` extra is installed
(``./dev setup`` installs it); skipped with the reason otherwise:

* the command without ``--address`` starts its own local Ray, runs every seed, stops it;
  with ``--address`` it sends the tasks to that cluster and leaves it running;
* a seed's result from a worker is the result of the same campaign run here (the fan-out
  runs the same campaign, not a look-alike);
* a planted defect is found by the fan-out and shrunk in the worker; the reported
  ``(seed, config, minimal trace)`` and replay command reproduce it here, and the same
  trace without the defect replays clean;
* the argument checks and the chunking bounds need no Ray.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from .__main__ import main
from .campaign import run_seed
from .fanout import FANOUT_CHUNK_SEEDS_MAX, chunks, parse_seeds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ray():
    try:
        import ray
    except ImportError:
        pytest.skip("Ray is not installed: the optional extra sandbox[cluster] (./dev setup installs it)")
    return ray


def test_the_command_starts_a_local_ray_runs_every_seed_and_stops_it(tmp_path):
    _ray()
    out = tmp_path / "results.jsonl"
    proc = subprocess.run([sys.executable, "-m", "sandbox_sim", "fanout", "--seeds", "0:6", "--steps", "40", "--faults",
                           "crash,torn", "--num-cpus", "2", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "on a local Ray with 2 CPU(s)" in proc.stdout, proc.stdout
    assert "fanout done: 6 seed(s)" in proc.stdout and "0 violation(s)" in proc.stdout, proc.stdout
    assert [json.loads(line)["seed"] for line in out.read_text().splitlines()] == list(range(6))


@pytest.fixture(scope="module")
def cluster():
    ray = _ray()
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=128 << 20)
    yield ray
    ray.shutdown()


def test_a_workers_result_is_the_same_campaign_run_here(cluster, tmp_path):
    out = tmp_path / "results.jsonl"
    assert main(["fanout", "--seeds", "10:14", "--steps", "60", "--faults", "crash,enospc,power", "--chunk", "3",
                 "--json", str(out)]) == 0
    got = {r["seed"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(got) == [10, 11, 12, 13]
    for seed in (10, 13):
        here = run_seed(seed, 60, {"crash", "enospc", "power"})
        assert {k: got[seed][k] for k in ("ops", "faults", "recoveries")} == {k: here[k] for k in ("ops", "faults", "recoveries")}
    assert cluster.is_initialized(), "fanout must not stop a Ray it did not start"


def test_a_planted_defect_is_found_and_shrunk_by_the_fan_out(cluster, tmp_path, capsys):
    out = tmp_path / "results.jsonl"
    assert main(["fanout", "--seeds", "4:8", "--steps", "300", "--plant", "forget_mode", "--chunk", "2",
                 "--shrink-budget", "60", "--json", str(out)]) == 1
    err = capsys.readouterr().err
    results = [json.loads(line) for line in out.read_text().splitlines()]
    bad = [r for r in results if "violation" in r]
    assert bad, results
    for r in bad:
        assert "mode" in r["minimal_error"] and len(r["trace"]) < 300, r
        assert f"VIOLATION seed {r['seed']}" in err and r["replay"] in err
    # the reported replay reproduces it here, and only with the defect
    argv = shlex.split(bad[0]["replay"])[3:]
    assert argv[:3] == ["replay", "--plant", "forget_mode"]
    assert main(argv) == 1
    assert main([a for a in argv if a not in ("--plant", "forget_mode")]) == 0


def test_a_planted_defect_is_found_on_a_cluster_whose_workers_ran_the_compiled_build(cluster, tmp_path):
    """Ray reuses a job's workers across tasks: a worker that loaded the compiled build
    (sandbox_sim/compiled.py) would not see a planted function. ``--plant`` tasks get workers
    of their own that never load it, so the defect is found (and ``plant`` itself refuses a
    compiled process rather than miss it)."""
    out = tmp_path / "compiled.jsonl"
    assert main(["fanout", "--seeds", "0:4", "--steps", "20", "--chunk", "1", "--json", str(out)]) == 0
    if not any(json.loads(line)["compiled"] for line in out.read_text().splitlines()):
        pytest.skip("no compiled build of this tree (python -m sandbox_sim compile): no worker loaded one")
    assert main(["fanout", "--seeds", "4:8", "--steps", "300", "--plant", "forget_mode", "--chunk", "1",
                 "--shrink-budget", "30"]) == 1


def test_bad_arguments_and_the_bounds_need_no_ray(capsys):
    assert main(["fanout", "--seeds", "5:2"]) == 2
    assert main(["fanout", "--seeds", "x"]) == 2
    assert main(["fanout", "--seeds", "0:3", "--faults", "meteor"]) == 2
    assert main(["fanout", "--seeds", "0:3", "--plant", "nothing"]) == 2
    assert parse_seeds("3:7") == range(3, 7)
    with pytest.raises(ValueError):
        parse_seeds("0:2000000")
    assert chunks(range(0, 200), cpus=2) == [list(range(i, i + 25)) for i in range(0, 200, 25)]
    assert max(map(len, chunks(range(0, 10_000), cpus=1))) == FANOUT_CHUNK_SEEDS_MAX
    assert chunks(range(5, 8), cpus=64) == [[5], [6], [7]]
    assert chunks(range(0, 5), cpus=1, chunk=2) == [[0, 1], [2, 3], [4]]


def test_docs_quote_the_fan_out_limits():
    """docs/simulation.md's limits table names every FANOUT_* constant with its real value."""
    import re

    from . import fanout

    text = open(os.path.join(ROOT, "docs", "simulation.md"), encoding="utf-8").read()
    rows = dict(re.findall(r"^\| `(FANOUT_[A-Z_]+)` \| ([^|]+) \|", text, re.M))
    names = {n for n in dir(fanout) if n.startswith("FANOUT_")}
    assert set(rows) == names, (set(rows) ^ names)
    for name, cell in rows.items():
        value = getattr(fanout, name)
        number = re.match(r"[\d,]+", cell.strip()).group(0).replace(",", "")
        unit = 1 << 20 if "MiB" in cell else 1
        assert int(number) * unit == value, (name, cell, value)


def test_docs_quote_the_other_research_limits():
    import re

    from sandbox.core import store
    from sandbox import hostfs
    from sandbox.hostfs import memory

    from . import campaign, compiled, explore

    text = open(os.path.join(ROOT, "docs", "simulation.md"), encoding="utf-8").read()
    where = {"CROSS_CHECK_EVERY": campaign, "EXPLORE_STATES_MAX": explore, "NORMALIZED_KEPT_MAX": hostfs,
             "PARSED_JOURNALS_KEPT_MAX": store, "PARSED_JOURNAL_KEPT_BYTES_MAX": store,
             "EXPLORE_LOSS_STATES_MAX": explore, "UNSYNCED_VERSIONS_MAX": memory,
             "RESOLVED_PATHS_KEPT_MAX": memory, "DECOMPRESSORS_KEPT_MAX": store, "INLINE_CHECKED_KEPT_MAX": store,
             "INLINE_CHECKED_BYTES_MAX": store, "BUILD_TIMEOUT_S": compiled}
    for name, module in where.items():
        m = re.search(rf"`{name}`\s*=\s*([\d,]+)( MiB)?", text)
        assert m, f"docs/simulation.md does not quote {name}"
        assert int(m.group(1).replace(",", "")) * ((1 << 20) if m.group(2) else 1) == getattr(module, name), name


def test_address_sends_the_tasks_to_a_running_cluster_and_leaves_it_running(cluster):
    address = cluster.get_runtime_context().gcs_address
    proc = subprocess.run([sys.executable, "-m", "sandbox_sim", "fanout", "--seeds", "0:3", "--steps", "30",
                           "--address", address], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"on {address}" in proc.stdout and "fanout done: 3 seed(s)" in proc.stdout, proc.stdout
    assert cluster.is_initialized() and cluster.cluster_resources().get("CPU") == 2
