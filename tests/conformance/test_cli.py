"""The `gradparity` command and the plugin, end to end (pytester runs them in a subprocess)."""

import json
import os
import textwrap

import pytest

pytestmark = pytest.mark.xdist_group("cli")

NO_BROADCAST = textwrap.dedent(
    """
    import torch.nn.parallel

    class NoInitSync(torch.nn.parallel.DistributedDataParallel):
        '''torch DDP without the construction-time broadcast.'''
        def __init__(self, module, **kwargs):
            super().__init__(module, init_sync=False, **kwargs)

    class Minimal(torch.nn.parallel.DistributedDataParallel):
        gradparity_capabilities = frozenset()
    """
)


@pytest.fixture
def env(pytester, monkeypatch):
    pytester.makepyfile(my_ddp=NO_BROADCAST)
    monkeypatch.setenv("PYTHONPATH", str(pytester.path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return pytester


@pytest.mark.parametrize(
    "args, needle",
    [
        (["run", "--adapter", "nope"], "unknown adapter 'nope'"),
        (["run", "--ddp-class", "nowhere.mod:Cls"], "cannot import 'nowhere.mod'"),
        (["run", "--world-size", "0"], "impossible world size 0"),
        (["run", "--scenario", "ddp/none/such"], "unknown scenario"),
        (["run", "--xfails", "missing.txt"], "does not exist"),
        (["run", "--xfails", "binary.txt"], "is not a text file (byte 3 is NUL)"),
        (["run", "--ddp-class", "torch.nn:Linear"], "'torch.nn:Linear' is not DDP-like"),
        (["run", "--report-dir", "/proc/gradparity/x"], "cannot write reports to '/proc/gradparity/x'"),
        (["run", "--profile", "bogus"], "invalid choice: 'bogus'"),
        (["run", "--adapter", "torch-ddp", "--world-size", "3"], "profile quick has no ddp scenario at world size 3 for adapter torch-ddp; --profile standard has"),
        (["zoo", "--profile", "bogus"], "invalid choice: 'bogus'"),
        # your own model (docs/your-model.md)
        (["run", "--model", "nowhere.mod:build", "--batch", "x:y"], "cannot import 'nowhere.mod'"),
        (["run", "--model", "tests.conformance.user_models:not_a_module", "--batch",
          "tests.conformance.user_models:batch"], "returned str, not a torch.nn.Module"),
        (["run", "--model", "tests.conformance.user_models:build"], "--model and --batch go together"),
        (["run", "--model", "tests.conformance.user_models:build_python_random", "--batch",
          "tests.conformance.user_models:batch"], "forward draws from Python's random"),
        (["zoo", "--report-dir", "/proc/gradparity/x"], "cannot write reports to '/proc/gradparity/x'"),
    ],
)
def test_bad_input_exits_2_with_one_line(env, capsys, args, needle):
    """In-process (the unit tier stays fast); the next test runs the real command once."""
    from conformance.frontends.cli import main

    (env.path / "binary.txt").write_bytes(b"abc\0\xff\n")
    env.syspathinsert()
    capsys.readouterr()
    try:
        code = main(args)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2
    assert len(err) == 1 and needle in err[0], err


def test_the_real_command_refuses_bad_input_with_one_line(env):
    result = env.run("gradparity", "run", "--ddp-class", "torch.nn:Linear")
    assert result.ret == 2
    err = [line for line in result.errlines if line.strip()]
    assert len(err) == 1 and "'torch.nn:Linear' is not DDP-like" in err[0], result.errlines


def test_list_shows_scenarios_and_adapters(capsys):
    from conformance.frontends.cli import main

    assert main(["list", "--profile", "quick"]) == 0
    out = capsys.readouterr().out
    assert "ddp/plain/mlp/w2/fp32" in out and "torch-ddp" in out


def test_list_shows_upstream_references(capsys):
    """An upstream reference like "[pytorch/pytorch#128949]" is text, not rich markup to drop."""
    from conformance.frontends.cli import main

    assert main(["list", "--profile", "full", "--area", "ddp"]) == 0
    assert "pytorch/pytorch#128949" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, needle",
    [(["--bogus-flag"], "pytest rejected the arguments after `--`"), (["--collect-only"], "no case was run")],
)
def test_pytest_arguments_that_run_nothing_are_not_a_pass(env, extra, needle):
    """A flag pytest rejects is bad input (2, our one line last); a run in which no case ran is not a pass."""
    result = env.run("gradparity", "run", "--adapter", "torch-ddp", "--scenario", "ddp/plain/mlp/w2/fp32",
                     "--report-dir", "out", "--", *extra, timeout=300)
    assert result.ret == 2, result.stdout.str()[-2000:]
    err = [line for line in result.errlines if line.strip()]
    assert needle in err[-1], err


@pytest.mark.slow
def test_run_writes_reports_and_passes(env):
    result = env.run("gradparity", "run", "--adapter", "torch-ddp", "--scenario", "ddp/plain/mlp/w2/fp32",
                     "--scenario", "ddp/no-sync/mlp/w2/fp32", "--report-dir", "out", timeout=300)
    assert result.ret == 0, result.stdout.str()[-3000:]
    report = json.loads((env.path / "out" / "gradparity.json").read_text())
    assert report["schema"] == "gradparity.report/3"
    assert report["summary"]["passed"] == 2 and report["run"]["backends"] == ["gloo"]
    assert report["adapters"][0]["version"] and report["environment"]["torch"]
    assert {r["tolerance"] for r in report["results"]} == {"bitwise"}
    assert (env.path / "out" / "junit.xml").exists()
    assert "torch-ddp" in (env.path / "out" / "gradparity.html").read_text()
    assert "conformant" in result.stdout.str()


@pytest.mark.slow
def test_broken_implementation_fails_with_a_useful_message(env):
    """Also: the report dir holds this run only (a stale junit.xml goes, a user's file stays), and an
    xfailed case keeps the error actually seen beside the reason it is expected."""
    (env.path / "out").mkdir()
    (env.path / "out" / "junit.xml").write_text("<stale/>")
    (env.path / "out" / "mine.txt").write_text("kept")
    (env.path / "xf.txt").write_text("ddp-class=my_ddp:NoInitSync|ddp/no-sync/mlp/w2/fp32  # no init sync (example/issue#7)\n")
    result = env.run("gradparity", "run", "--ddp-class", "my_ddp:NoInitSync", "--scenario", "ddp/plain/mlp/w2/fp32",
                     "--scenario", "ddp/no-sync/mlp/w2/fp32", "--xfails", "xf.txt", "--report-dir", "out", timeout=300)
    assert result.ret == 1
    report = json.loads((env.path / "out" / "gradparity.json").read_text())
    assert report["run"]["command"].startswith("gradparity run --ddp-class my_ddp:NoInitSync")
    xfailed, case = sorted(report["results"], key=lambda r: r["verdict"], reverse=True)
    assert xfailed["verdict"] == "xfailed" and xfailed["xfail_reason"] == "no init sync (example/issue#7)"
    assert "rank 1, after construction" in xfailed["message"]
    junit = (env.path / "out" / "junit.xml").read_text()
    assert "<stale/>" not in junit and 'name="gradparity"' in junit and "rank 1, after construction" in junit
    assert (env.path / "out" / "mine.txt").read_text() == "kept"
    assert case["verdict"] == "failed" and case["failure_class"] == "wrong value"
    assert case["cause"].startswith("[ddp/plain/mlp/w2/fp32] adapter ddp-class=my_ddp:NoInitSync: rank 1, after construction")
    assert "[wrong value] [ddp/plain/mlp/w2/fp32]" in result.stdout.str()
    assert "rank 1, after construction" in case["message"] and "repro: gradparity run --ddp-class my_ddp:NoInitSync" in case["message"]


@pytest.mark.slow
def test_missing_capability_skips_and_names_it(env):
    result = env.run("gradparity", "run", "--ddp-class", "my_ddp:Minimal", "--scenario", "ddp/no-sync/mlp/w2/fp32",
                     "--scenario", "ddp/plain/mlp/w2/fp32", "--report-dir", "out", "-v", "--", "-rs", timeout=300)
    assert result.ret == 0, result.stdout.str()[-3000:]
    assert "Minimal lacks capability: no_sync" in result.stdout.str()


@pytest.mark.slow
def test_plain_pytest_with_xfails_file(env):
    env.path.joinpath("xfails.txt").write_text(
        "torch-ddp|ddp/plain/mlp/w1/fp32  # pretend it is known broken\n"
        "# a comment line\n"
        "torch-ddp|ddp/does-not-exist  # stale entry\n"
    )
    result = env.runpytest_subprocess("--pyargs", "conformance.suite", "--adapter", "torch-ddp",
                                      "--scenario", "ddp/plain/mlp/w1/fp32", "--xfails", "xfails.txt", "-p", "no:cacheprovider")
    # strict xfail: a listed case that passes is reported (XPASS(strict) fails the run)
    assert result.ret == 1
    out = result.stdout.str()
    assert "XPASS(strict)" in out or "xpassed" in out.lower()
    assert "matches no collected case" in out


@pytest.mark.slow
def test_an_infrastructure_failure_is_an_error_everywhere(env, monkeypatch):
    """A pool that cannot start (here: a startup budget nobody can meet) is retried once, then
    reported as an `error` of class infrastructure: in JSON, JUnit and the terminal, never `failed`."""
    monkeypatch.setenv("GRADPARITY_STARTUP_TIMEOUT", "0.01")
    # spawned ranks: a world forked from the fork server can be ready within one poll of the
    # coordinator (0.5 s), before the budget is ever checked
    monkeypatch.setenv("GRADPARITY_START_METHOD", "spawn")
    result = env.run("gradparity", "run", "--adapter", "torch-ddp", "--scenario", "ddp/plain/mlp/w2/fp32",
                     "--scenario", "ddp/no-sync/mlp/w2/fp32", "-x", "--report-dir", "out", timeout=300)
    assert result.ret == 3, "only infrastructure errors: exit status 3, not a failure (1)"
    report = json.loads((env.path / "out" / "gradparity.json").read_text())
    (case,) = report["results"]
    assert case["verdict"] == "error" and case["failure_class"] == "infrastructure", case
    assert "could not start ranks" in case["cause"]
    assert report["summary"]["error"] == 1 and report["summary"]["failed"] == 0
    assert report["summary"]["failure_classes"]["infrastructure"] == 1
    junit = (env.path / "out" / "junit.xml").read_text()
    assert "<error" in junit and "<failure" not in junit
    out = " ".join(result.stdout.str().split())  # the terminal wraps long lines
    assert "[infrastructure] rank 0: could not start ranks for w2/gloo/cpu: rank 0 timeout: waiting for ready" in out
    assert "NO VERDICT" in out
    # -x stopped the run after the first case: the reports and the terminal say so, and how much is missing
    assert report["run"]["stopped"] == "stopping after 1 failures; 1 of 2 selected cases have no result"
    assert 'name="stopped" value="stopping after 1 failures' in junit
    assert "the run ended early: stopping after 1 failures; 1 of 2 selected cases have no result" in out
