"""The allocator a training command runs with: glibc settings that keep freed memory.

By default glibc hands large tensors back to the OS after every step and maps them in again on the next; on
small Linux VMs that made CPU training slower (measured: docs/results.md). glibc reads its settings when a
process starts, so a command re-runs itself once with them, before it imports torch.
"""
import os
import sys

FAST_MALLOC = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "100000000000", "MALLOC_TOP_PAD_": "1000000000"}


def use_fast_malloc():
    """Re-run this command once with FAST_MALLOC in its environment (on Linux; nothing elsewhere)."""
    if sys.platform == "linux" and not any(k in os.environ for k in FAST_MALLOC):
        os.execve(sys.executable, [sys.executable] + sys.argv, {**os.environ, **FAST_MALLOC})
