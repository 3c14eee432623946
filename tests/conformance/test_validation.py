"""Bad input is refused by reading files, signatures and the catalogue: no process is started."""

import pytest
import torch
from torch import nn

from conformance.adapters import registry
from conformance.adapters.ddp_like import (
    DDPLikeAdapter,
    constructor_problem,
    missing_capabilities_of,
)
from conformance.spec import Capability
from conformance.validation import (
    UsageError,
    check_expectations_file,
    check_report_dir,
    check_world_sizes,
)


class NoHooks:
    """DDP-like constructor and no_sync, but no register_comm_hook and no bucket_cap_mb keyword."""

    def __init__(self, module, process_group=None, find_unused_parameters=False):
        self.module = module

    def no_sync(self):
        raise NotImplementedError


class Declared(NoHooks):
    gradparity_capabilities = frozenset({Capability.NO_SYNC})


def test_a_class_that_is_not_ddp_like_is_refused_with_its_signature():
    problem = constructor_problem(nn.Linear)
    assert "Linear(in_features" in problem and "missing a required argument" in problem
    assert constructor_problem(torch.nn.parallel.DistributedDataParallel) is None
    with pytest.raises(registry.AdapterError, match="is not DDP-like"):
        registry.load(registry.ddp_class_spec("torch.nn:Linear"))


def test_missing_methods_and_keywords_drop_their_capabilities():
    missing = missing_capabilities_of(NoHooks)
    assert {Capability.COMM_HOOK, Capability.BUCKET_CAP, Capability.STATIC_GRAPH} <= missing
    assert Capability.NO_SYNC not in missing
    adapter = DDPLikeAdapter("nohooks", NoHooks, version="0")
    assert Capability.COMM_HOOK not in adapter.capabilities and Capability.NO_SYNC in adapter.capabilities
    assert missing_capabilities_of(torch.nn.parallel.DistributedDataParallel) == frozenset()


def test_declared_capabilities_are_taken_at_their_word():
    assert DDPLikeAdapter("declared", Declared, version="0").capabilities == {Capability.NO_SYNC}


def test_report_dir_must_be_writable(tmp_path):
    check_report_dir(str(tmp_path / "new" / "dir"))
    assert not (tmp_path / "new").exists()  # checked, and no trace left
    check_report_dir(str(tmp_path))
    assert not list(tmp_path.iterdir())
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UsageError, match="cannot write reports"):
        check_report_dir(str(blocker / "sub"))


def test_expectations_file_must_be_text(tmp_path):
    good = tmp_path / "good.txt"
    good.write_text("torch-ddp|ddp/plain/mlp/w2/fp32  # why\n")
    check_expectations_file(str(good))
    for name, data, needle in (("nul.txt", b"a\0b", "byte 1 is NUL"), ("latin.txt", b"caf\xe9", "byte 3 is not UTF-8")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(UsageError, match=needle):
            check_expectations_file(str(tmp_path / name))
    with pytest.raises(UsageError, match="not a regular file"):
        check_expectations_file(str(tmp_path))


def test_a_world_size_the_profile_lacks_names_the_profile_that_has_it():
    ddp = {"torch-ddp": registry.load("torch-ddp")}
    with pytest.raises(UsageError, match=r"profile quick has no ddp scenario at world size 3 .*--profile standard has \d+"):
        check_world_sizes("quick", [3], ddp)
    check_world_sizes("standard", [3], ddp)
    check_world_sizes("quick", [3], ddp, ids=["ddp/plain/mlp/w3/fp32"])  # explicit ids pick their own scenarios
    with pytest.raises(UsageError, match="impossible world size 0"):
        check_world_sizes("quick", [0], ddp)
