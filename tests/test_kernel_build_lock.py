"""The kernel build (layers/kernel_build.py): a lock left by a killed build does not hang the next engine start;
build names follow the sources, their path and the flags, and nothing else."""
import os
import threading
import time

from openinfer.layers import kernel_build


def test_an_old_lock_is_removed_at_once(tmp_path, monkeypatch):
    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - 3600
    os.utime(lock, (old, old))
    kernel_build.clear_stale_lock(str(tmp_path))
    assert not lock.exists()


def test_a_young_lock_is_waited_on_then_removed_when_it_outlives_the_bound(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENINFER_KERNEL_LOCK_STALE_S", "1.5")
    lock = tmp_path / "lock"
    lock.touch()
    kernel_build.clear_stale_lock(str(tmp_path))
    assert lock.exists()  # another process may still be building
    deadline = time.monotonic() + 10
    while lock.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not lock.exists()


def test_no_lock_no_watcher(tmp_path):
    before = {t.name for t in threading.enumerate()}
    kernel_build.clear_stale_lock(str(tmp_path))
    assert "kernel-lock-watch" not in {t.name for t in threading.enumerate()} - before


def test_two_checkouts_of_the_same_kernels_build_apart(tmp_path):
    """torch's build.ninja names the sources by path: a second checkout sharing the cache directory must get its own
    build directory, or each would rebuild everything on the other's next load. The same checkout keeps its name;
    an edited source gets a new one."""
    import shutil

    copy = tmp_path / "cpu_kernels"
    shutil.copytree(kernel_build.KERNEL_DIR, copy)
    flags = kernel_build.cflags()
    here = kernel_build.extension_name(flags)
    assert here == kernel_build.extension_name(flags, kernel_build.KERNEL_DIR)
    there = kernel_build.extension_name(flags, copy)
    assert there != here and there == kernel_build.extension_name(flags, copy)
    next(copy.glob("*.cpp")).write_text("// edited\n", encoding="utf-8")
    assert kernel_build.extension_name(flags, copy) not in (here, there)


def test_a_load_leaves_the_next_builds_name_alone(kernel_ops):
    """torch's cpp_extension.load appends its own libraries to the extra_ldflags list it is given: handed the
    module's list, it changed the hash of every later build in the process, which then built afresh under another
    name (seen: the same x86-64-v3 build twice in one process)."""
    extra, cache_dir = next(key for key, r in kernel_build._results.items() if isinstance(r, kernel_build.BuildResult))
    name = kernel_build.extension_name(kernel_build.cflags("-march=x86-64-v3"))
    kernel_build._build(extra, cache_dir)  # the build kernel_ops loaded: cached, loaded again (the same library)
    assert kernel_build.extension_name(kernel_build.cflags("-march=x86-64-v3")) == name
