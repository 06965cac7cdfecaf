"""kvguard-bisect: the search over toy releases (a function from version to outcome), the
package index's output, a gate report read as good or bad, the command's errors, and one real
step on mlx-lm 0.28.0 with the real gate."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

import pytest_kvguard
from pytest_kvguard.cli import bisect as bisect_cli
from pytest_kvguard.core.errors import KvguardError
from pytest_kvguard.isolation.bisection import (
    BAD,
    CRASH,
    GOOD,
    UNUSABLE,
    Bisection,
    CheckResult,
    EndpointError,
    Trial,
    bisect_releases,
    estimate_lines,
    parse_index_versions,
    read_report,
    releases_between,
    steps_needed,
)
from pytest_kvguard.isolation.environments import default_root

RELEASES = [f"1.{minor}" for minor in range(10)]  # 1.0 (good) ... 1.9 (bad)


def toy_engine(
    first_bad: str, odd: Mapping[str, str] | None = None
) -> tuple[Callable[[str], Trial], list[str]]:
    """A release is bad from ``first_bad`` on; ``odd`` overrides some (CRASH, UNUSABLE).
    Returns the test function and the versions it was asked about, in order."""
    asked: list[str] = []

    def test(version: str) -> Trial:
        asked.append(version)
        outcome = (odd or {}).get(version) or (
            BAD if RELEASES.index(version) >= RELEASES.index(first_bad) else GOOD
        )
        return Trial(version, outcome, f"toy {outcome}")

    return test, asked


def search(first_bad: str, odd: Mapping[str, str] | None = None, **options: Any) -> Bisection:
    test, _ = toy_engine(first_bad, odd)
    return bisect_releases(RELEASES, test, **options)


@pytest.mark.parametrize("first_bad", RELEASES[1:])
def test_the_first_bad_release_is_found_wherever_it_is(first_bad: str) -> None:
    test, asked = toy_engine(first_bad)
    result = bisect_releases(RELEASES, test)
    assert result.exact and result.first_bad == first_bad
    assert result.last_good == RELEASES[RELEASES.index(first_bad) - 1]
    # Both ends, then halving: never more than ceil(log2(9)) = 4 releases between.
    assert asked[:2] == ["1.0", "1.9"] and len(asked) <= 2 + steps_needed(len(RELEASES))
    assert len(set(asked)) == len(asked)


def test_the_middle_release_is_tried_first() -> None:
    test, asked = toy_engine("1.6")
    bisect_releases(RELEASES, test)
    assert asked == ["1.0", "1.9", "1.4", "1.6", "1.5"]


def test_adjacent_good_and_bad_need_no_step() -> None:
    test, asked = toy_engine("1.1")
    result = bisect_releases(["1.0", "1.1"], test)
    assert (result.last_good, result.first_bad, result.exact) == ("1.0", "1.1", True)
    assert asked == ["1.0", "1.1"]


def test_an_untestable_release_in_the_middle_is_stepped_around() -> None:
    result = search("1.7", {"1.4": UNUSABLE})
    assert result.exact and (result.last_good, result.first_bad) == ("1.6", "1.7")
    assert result.skipped == ("1.4",)
    assert [t.version for t in result.trials][2:4] == ["1.4", "1.5"]  # then its neighbour


def test_an_untestable_release_at_the_boundary_leaves_a_range() -> None:
    """1.5 is the real first bad release but cannot be tested: the answer is 1.5 or 1.6."""
    result = search("1.5", {"1.5": UNUSABLE})
    assert not result.exact and result.stopped is None
    assert (result.last_good, result.untested, result.first_bad) == ("1.4", ("1.5",), "1.6")
    assert result.skipped == ("1.5",)


def test_two_untestable_releases_widen_the_range() -> None:
    result = search("1.6", {"1.5": UNUSABLE, "1.6": UNUSABLE})
    assert (result.last_good, result.untested, result.first_bad) == ("1.4", ("1.5", "1.6"), "1.7")


def test_a_crash_is_skipped_unless_crash_is_bad() -> None:
    skipped = search("1.5", {"1.5": CRASH})
    assert (skipped.untested, skipped.first_bad) == (("1.5",), "1.6")
    counted = search("1.5", {"1.5": CRASH}, crash_is_bad=True)
    assert counted.exact and (counted.last_good, counted.first_bad) == ("1.4", "1.5")
    assert counted.skipped == ()


@pytest.mark.parametrize(
    ("odd", "first_bad", "message"),
    [
        ({}, "1.0", "--good 1.0 is bad, not good: toy bad"),
        ({"1.0": UNUSABLE}, "1.5", "--good 1.0 is untestable, not good"),
        ({}, "1.9", None),  # the control: 1.9 is bad, all is well
        ({"1.9": GOOD}, "1.5", "--bad 1.9 is good, not bad: toy good"),
        ({"1.9": CRASH}, "1.5", "--bad 1.9 is untestable, not bad"),
    ],
)
def test_an_end_that_is_not_what_was_said_stops_the_search(
    odd: dict[str, str], first_bad: str, message: str | None
) -> None:
    test, asked = toy_engine(first_bad, odd)
    if message is None:
        assert bisect_releases(RELEASES, test).first_bad == "1.9"
        return
    with pytest.raises(EndpointError, match=message.replace(".", r"\.")):
        bisect_releases(RELEASES, test)
    assert len(asked) <= 2


def test_the_build_cap_stops_with_the_range_narrowed_so_far() -> None:
    test, asked = toy_engine("1.6")
    cached = {"1.0", "1.9", "1.4"}  # the ends and the first middle are made already
    result = bisect_releases(RELEASES, test, is_cached=cached.__contains__, max_builds=1)
    assert asked == ["1.0", "1.9", "1.4", "1.6"]  # one build: 1.6
    assert result.stopped == "--max-builds 1 reached"
    assert (result.last_good, result.untested, result.first_bad) == ("1.4", ("1.5",), "1.6")


def test_the_build_cap_counts_a_cached_release_as_free_and_prefers_it() -> None:
    """1.4 and 1.5 are equally near the middle of 1.0..1.9; 1.5 is cached, so it goes first."""
    test, asked = toy_engine("1.6")
    result = bisect_releases(
        RELEASES, test, is_cached={"1.0", "1.9", "1.5"}.__contains__, max_builds=0
    )
    assert asked == ["1.0", "1.9", "1.5"]
    assert (result.last_good, result.first_bad, result.stopped) == (
        "1.5",
        "1.9",
        "--max-builds 0 reached",
    )


def test_at_the_build_cap_a_cached_release_far_from_the_middle_still_narrows_the_range() -> None:
    test, asked = toy_engine("1.6")
    result = bisect_releases(
        RELEASES, test, is_cached={"1.0", "1.9", "1.2"}.__contains__, max_builds=0
    )
    assert asked == ["1.0", "1.9", "1.2"]
    assert (result.last_good, result.first_bad) == ("1.2", "1.9") and result.stopped


def test_a_cap_of_zero_builds_with_an_uncached_end_tests_nothing() -> None:
    test, asked = toy_engine("1.6")
    result = bisect_releases(RELEASES, test, is_cached=lambda v: False, max_builds=0)
    assert asked == [] and result.stopped and result.untested == tuple(RELEASES[1:-1])


PIP_INDEX_OUTPUT = """\
WARNING: Location 'file:///opt/pypi/simple/mlx-lm/' is ignored: it is neither a file nor a directory.
mlx-lm (0.32.2)
Available versions: 0.32.2, 0.32.1, 0.32.0, 0.31.3, 0.31.2, 0.31.1, 0.30.7, 0.30.6, 0.30.5, 0.30.4, 0.30.2, 0.30.0, 0.29.1, 0.28.4, 0.28.3, 0.28.2, 0.28.1, 0.28.0, 0.27.1
  INSTALLED: 0.32.2
  LATEST:    0.32.2
"""  # noqa: E501  (pip's own output, as printed on this machine)


def test_pip_index_versions_output_is_read() -> None:
    versions = parse_index_versions(PIP_INDEX_OUTPUT)
    assert versions[:3] == ["0.32.2", "0.32.1", "0.32.0"] and versions[-1] == "0.27.1"
    assert releases_between(versions, "0.28.0", "0.31.1") == [
        "0.28.0", "0.28.1", "0.28.2", "0.28.3", "0.28.4", "0.29.1", "0.30.0", "0.30.2",
        "0.30.4", "0.30.5", "0.30.6", "0.30.7", "0.31.1",
    ]  # fmt: skip


def test_output_without_the_versions_line_is_an_error_naming_the_fix() -> None:
    with pytest.raises(KvguardError, match="no 'Available versions:' line.*--versions"):
        parse_index_versions("ERROR: No matching distribution found for mlx-lm\n")


def test_pre_releases_are_left_out_unless_asked_and_versions_sort_numerically() -> None:
    listed = ["0.10.0", "0.9.0", "0.10.0rc1", "0.9.1.dev3", "0.9.1", "0.9.1.post1", "junk", "0.8"]
    assert releases_between(listed, "0.8", "0.11.0") == [
        "0.8", "0.9.0", "0.9.1", "0.9.1.post1", "0.10.0", "0.11.0"
    ]  # fmt: skip
    with_pre = releases_between(listed, "0.8", "0.11.0", pre=True)
    assert with_pre == ["0.8", "0.9.0", "0.9.1.dev3", "0.9.1", "0.9.1.post1", "0.10.0rc1",
                        "0.10.0", "0.11.0"]  # fmt: skip


@pytest.mark.parametrize(
    ("good", "bad", "message"),
    [("0.9", "0.9", "--good 0.9 is not older than --bad 0.9"), ("x.y", "1.0", "--good: 'x.y'")],
)
def test_ends_in_the_wrong_order_or_unparsable_are_refused(
    good: str, bad: str, message: str
) -> None:
    with pytest.raises(KvguardError, match=message):
        releases_between(["0.9"], good, bad)


def test_the_estimate_counts_steps_cached_environments_and_build_time() -> None:
    releases = [f"0.3.{n}" for n in range(10, 37)]  # 27 llama-cpp-python releases
    lines = estimate_lines(releases, ["0.3.10", "0.3.20"], "llama-cpp-python")
    assert "27 releases from 0.3.10 to 0.3.36 (25 between)" in lines[0]
    assert "about 5 steps (ceil(log2(26)))" in lines[0]
    # 0.3.36 and at most 5 of those between: 6 builds of 9 minutes.
    assert "2 of 27 cached, up to 6 to build (about 9 min 0 s each" in lines[1]
    assert "about 54 min 0 s building" in lines[1]


def _row(name: str, verdict: str, **extra: Any) -> dict[str, Any]:
    row = {"name": name, "scenario": "memory", "engine": "mlx", "engine_version": "0.28.1",
           "verdict": verdict, "violations": [], "metrics": {"kv_entries": 256}}  # fmt: skip
    return row | extra


def _report(*rows: dict[str, Any], missing: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"checks": list(rows), "missing_checks": list(missing)}


def test_a_report_reads_good_bad_or_untestable() -> None:
    picked = ["cap", "sink"]
    good = _report(_row("cap", "PASS"), _row("sink", "CAUGHT"), _row("other", "FAIL"))
    assert read_report(good, picked, "mlx", "0.28.1", "")[0] == GOOD  # "other" is not picked
    failed = _report(_row("cap", "FAIL", violations=["max_kv_entries: 384 > 256", "more"]),
                     _row("sink", "MISSED"))  # fmt: skip
    outcome, reason, checks = read_report(failed, picked, "mlx", "0.28.1", "")
    assert outcome == BAD and reason == "cap FAIL: max_kv_entries: 384 > 256 (and 1 more)"
    assert checks[0] == CheckResult("cap", "memory", "FAIL", "0.28.1", "max_kv_entries: 384 > 256",
                                    {"kv_entries": 256})  # fmt: skip
    errored = _report({"name": "cap", "verdict": "ERROR", "error": "engine refused"},
                      _row("sink", "PASS"))  # fmt: skip
    assert read_report(errored, picked, "mlx", "0.28.1", "")[:2] == (
        BAD,
        "cap ERROR: engine refused",
    )
    not_run = _report(_row("cap", "PASS"))
    assert read_report(not_run, picked, "mlx", "0.28.1", "")[:2] == (UNUSABLE, "did not run: sink")
    lost = _report(_row("cap", "PASS"), _row("sink", "PASS"), missing=("sink",))
    assert read_report(lost, picked, "mlx", "0.28.1", "")[0] == UNUSABLE
    assert read_report(good, picked, "mlx", "0.28.2", "")[:2] == (
        UNUSABLE, "cap ran mlx 0.28.1, not 0.28.2"
    )  # fmt: skip
    assert read_report(None, picked, "mlx", "0.28.1", "pytest exit 3: boom") == (
        CRASH, "the gate run wrote no report (pytest exit 3: boom)", ()
    )  # fmt: skip


# The command, with the environments and gate runs of the toy engine above.


@pytest.fixture
def toy_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """kvguard-bisect with every release from 0.1.0 (good) to 0.1.9 answered by a toy gate:
    bad from 0.1.6 on; 0.1.5 never installs. Nothing is built or run."""
    budgets = tmp_path / "budgets.yaml"
    budgets.write_text("version: 1\nchecks: []\n")

    def try_release(distribution: str, version: str, *args: Any) -> Trial:
        number = int(version.rsplit(".", 1)[1])
        figures = {"kv_entries": 256.0 if number < 6 else 384.0, "kv_bytes_predicted": number}
        verdict = "PASS" if number < 6 else "FAIL"
        check = CheckResult("cap", "memory", verdict, version, "" if number < 6 else "384 > 256",
                            figures)  # fmt: skip
        if number == 5:
            return Trial(version, UNUSABLE, "environment not made: no such release", built=True)
        outcome = GOOD if number < 6 else BAD
        return Trial(version, outcome, f"cap {verdict}", (check,), seconds=1.5, built=True)

    monkeypatch.setattr(bisect_cli, "try_release", try_release)
    monkeypatch.setattr(bisect_cli, "picked_checks", lambda budgets, expression: ["cap"])
    monkeypatch.setattr(bisect_cli, "require_engine", lambda budgets, picked, engine: None)
    monkeypatch.setattr(bisect_cli, "is_cached", lambda distribution, version, root: False)
    return budgets


def _bisect(budgets: Path, *extra: str) -> int:
    versions = ",".join(f"0.1.{n}" for n in range(1, 9))
    return bisect_cli.main([str(budgets), "--engine", "mlx", "--good", "mlx-lm==0.1.0",
                            "--bad", "0.1.9", "--versions", versions, *extra])  # fmt: skip


def test_the_command_prints_progress_the_answer_and_both_neighbours_figures(
    toy_command: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert _bisect(toy_command, "--json", str(tmp_path / "log.json")) == 0
    out, err = capsys.readouterr()
    assert "[bisect] 10 releases from 0.1.0 to 0.1.9 (8 between)" in err
    assert "[bisect] 0.1.6: bad (cap FAIL) 1.5 s, environment built" in err
    assert "[bisect] 0.1.5: skipped (untestable) (environment not made: no such release)" in err
    lines = out.splitlines()
    assert lines[0] == (
        "first bad release: one of mlx-lm 0.1.5, 0.1.6 (last good: 0.1.4; untestable: 0.1.5: "
        "environment not made: no such release)"
    )
    table = "\n".join(lines[2:5])
    assert "0.1.4" in table and "0.1.6" in table and "kv_entries" in table
    assert "256" in table and "384" in table and "+50.00%" in table and "PASS -> FAIL" in table
    assert "kv_bytes_predicted" not in out  # not a figure a baseline compares
    log = json.loads((tmp_path / "log.json").read_text())
    assert [t["version"] for t in log["tested"]][:2] == ["0.1.0", "0.1.9"]
    assert log["result"]["untested"] == ["0.1.5"] and log["result"]["first_bad"] == "0.1.6"
    assert log["tested"][0]["checks"][0]["metrics"]["kv_entries"] == 256


def test_the_command_stops_at_the_build_cap_with_exit_1(
    toy_command: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _bisect(toy_command, "--max-builds", "3") == 1
    out, err = capsys.readouterr()
    assert "up to 6 to build" in err
    assert out.startswith(
        "stopped (--max-builds 3 reached): the first bad release is one of 0.1.5, 0.1.6, 0.1.7, "
        "0.1.8, 0.1.9 (last good 0.1.4, first known bad 0.1.9)"
    )


def test_a_good_end_that_is_bad_is_one_line_and_exit_2(
    toy_command: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = bisect_cli.main([str(toy_command), "--engine", "mlx", "--good", "0.1.7",
                            "--bad", "0.1.9", "--versions", "0.1.8"])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == (
        "error: --good 0.1.7 is bad, not good: cap FAIL (fix: give an older --good release "
        "that passes the picked checks)"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine", "vllm"], "error: unknown engine 'vllm'"),
        (["--engine", "llama_server"], "error: engine llama_server is a program, not a Python"),
        (
            ["--good", "llama-cpp-python==0.28.0"],
            "error: --good 'llama-cpp-python==0.28.0' "
            'names llama-cpp-python, not mlx-lm (fix: write --good "mlx-lm==VERSION"',
        ),
        (["--bad", "latest"], "error: --bad: 'latest' is not a version"),
        (["--good", "0.29.0", "--bad", "0.28.0"], "error: --good 0.29.0 is not older"),
        (["--budgets", "missing.yaml"], "error: missing.yaml: no budgets file there"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    budgets = tmp_path / "budgets.yaml"
    budgets.write_text("version: 1\nchecks: []\n")
    given = {"--budgets": str(budgets), "--engine": "mlx", "--good": "0.28.0",
             "--bad": "0.28.2"}  # fmt: skip
    given.update(zip(args[::2], args[1::2], strict=True))
    path = given.pop("--budgets")
    code = bisect_cli.main([path, *(x for pair in given.items() for x in pair),
                            "--versions", "0.28.1"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(message) and len(err.splitlines()) == 1, err


def test_a_check_expression_that_picks_nothing_is_refused_before_anything_is_built(
    tmp_path: Path,
) -> None:
    """The real collection in this environment (about a second), no environment made."""
    budgets = tmp_path / "budgets.yaml"
    budgets.write_text(BUDGETS)
    assert bisect_cli.picked_checks(budgets, "cap256") == [CAP_CHECK]
    with pytest.raises(KvguardError, match="-k 'nothing' picks no check in"):
        bisect_cli.picked_checks(budgets, "nothing")
    broken = tmp_path / "broken.yaml"
    broken.write_text(BUDGETS.replace("engine_default", "nope"))
    with pytest.raises(KvguardError) as refused:
        bisect_cli.picked_checks(broken, None)
    assert str(refused.value) == (
        f"{broken}:7: unknown policy 'nope' (fix: use one of full, window, sink, swa, swa_full, "
        "engine_default)"
    )
    bisect_cli.require_engine(budgets, [CAP_CHECK], "mlx")
    with pytest.raises(
        KvguardError,
        match=r"no picked check runs on engine llama_cpp \(they run "
        r"on mlx\) \(fix: pick a check of llama_cpp with -k, or bisect --engine mlx",
    ):
        bisect_cli.require_engine(budgets, [CAP_CHECK], "llama_cpp")


# One real step: mlx-lm 0.28.0 with the real gate.

CAP_CHECK = "smollm2-mlx-engine-default-cap256"
BUDGETS = f"""\
version: 1
checks:
  - name: {CAP_CHECK}
    scenario: memory
    engine: mlx
    model: smollm2-135m
    policy: engine_default
    params: {{cap: 256, lengths: [256, 384]}}
    budgets: {{max_kv_entries: 256}}
"""
"""docs/environments.md's cap check: 0.28.0 keeps 256 entries, every later release 384."""


def test_the_gate_runs_this_pytest_kvguard() -> None:
    """A checkout's plugin, not the copy installed in the environment."""
    first = bisect_cli.gate_environment()["PYTHONPATH"].split(":")[0]
    linked = (Path(first) / "pytest_kvguard").resolve()
    assert linked == Path(pytest_kvguard.__file__).parent.resolve()


@pytest.mark.engine
@pytest.mark.mlx
def test_a_real_step_classifies_mlx_lm_0_28_0_as_good_on_the_cap_check(tmp_path: Path) -> None:
    """kvguard-env's cached 0.28.0 environment (made here if missing, about 30 s, as
    tests/test_engine_upgrades.py does) and one real gate subprocess (about 20 s)."""
    budgets = tmp_path / "budgets.yaml"
    budgets.write_text(BUDGETS)
    trial = bisect_cli.try_release(
        "mlx-lm", "0.28.0", "mlx", budgets, "cap256", [CAP_CHECK], default_root()
    )
    assert (trial.outcome, trial.reason) == (GOOD, f"{CAP_CHECK} PASS"), trial
    (check,) = trial.checks
    assert check.engine_version == "0.28.0" and check.verdict == "PASS"
    assert check.metrics["kv_entries"] == 256 and check.metrics["kv_bytes"] == 11_796_480
    assert bisect_cli.is_cached("mlx-lm", "0.28.0", default_root())


def test_a_release_whose_environment_does_not_install_is_untestable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """No gate run: the trial says why, and counts as a build (nothing was cached)."""

    def refuse(requested: list[str], root: Path) -> Path:
        raise KvguardError(
            "pip install ... failed (exit 1):\nERROR: No matching distribution found for "
            f"{requested[0]}",
            fix="check the requirement's name and version, and the package index",
        )

    monkeypatch.setattr(bisect_cli, "create_environment", refuse)
    trial = bisect_cli.try_release(
        "mlx-lm", "0.28.9", "mlx", tmp_path / "budgets.yaml", None, [CAP_CHECK], tmp_path
    )
    assert (trial.outcome, trial.reason, trial.built) == (
        UNUSABLE,
        "environment not made: pip install ... failed (exit 1): ERROR: No matching distribution "
        "found for mlx-lm==0.28.9",
        True,
    )  # fmt: skip
    assert trial.checks == ()
