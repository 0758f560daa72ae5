"""`launch.deepspeed.patches.patch_deepspeed`, the one entry to what this project changes inside
DeepSpeed: a patch whose target has moved (a DeepSpeed release past the ones it was written for)
is skipped with one warning, once, and the others still apply."""

import deepspeed.ops

from launch.deepspeed import patches


def test_a_patch_that_no_longer_applies_is_skipped_with_one_warning(monkeypatch, capsys):
    def leave_shm_comm_op_unbuilt():
        raise AttributeError("module 'deepspeed.ops' has no attribute '__compatible_ops__'")

    monkeypatch.setattr(patches, "leave_shm_comm_op_unbuilt", leave_shm_comm_op_unbuilt)
    monkeypatch.setattr(patches, "_warned", set())
    patches.patch_deepspeed()
    patches.patch_deepspeed()  # idempotent, and the warning is not repeated
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"warning: DeepSpeed {deepspeed.__version__}: start-up patch ")
    assert "leave_shm_comm_op_unbuilt does not apply (AttributeError: module" in lines[0]
    assert f"written for {patches.PATCHED_FOR}); running without it" in lines[0]


def test_the_patches_apply_to_the_installed_deepspeed(capsys):
    patches.patch_deepspeed(cpu_adam=True)
    assert capsys.readouterr().err == ""
    assert deepspeed.ops.__compatible_ops__[patches.SHM_COMM_OP] is False
    from deepspeed.ops.adam import cpu_adam

    assert hasattr(cpu_adam.CPUAdamBuilder.cxx_args, "deepspeeds")  # built without -g
