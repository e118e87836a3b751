"""On the GPU machine: does the carried .kcache (prebuild_kcache.sh) serve this machine's kernels?

Runs `mla check --quick --backend cute_dsl_mla` in this process with the kernel-cache log on, then prints the
cache's counters: disk hits mean the keys made on the CPU match the device's; compiles mean they do not (or the
kernel was not prebuilt). Exit status 1 when nothing came from the disk.
"""
import logging
import sys
import time

from mlacore.tools.cli import main as mla_main


def run() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("mla_cute_dsl").setLevel(logging.INFO)
    start = time.perf_counter()
    rc = mla_main(["check", "--quick", "--backend", "cute_dsl_mla", "--device", "cuda"])
    from mla_cute_dsl.kernels import kernel_cache

    stats = kernel_cache.stats()
    print(f"mla check rc={rc} in {time.perf_counter() - start:.1f} s; kernel cache: {stats}")
    return 0 if stats.get("disk_hits", 0) > 0 else 1


if __name__ == "__main__":
    sys.exit(run())
