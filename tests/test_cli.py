"""The `mla` command: explain, policy check, check; user mistakes give one line and exit 2."""

import json
import subprocess
import sys


from mlacore.tools.cli import main
from mla_test_helpers import subprocess_env


def run_cli(*args, plugin_site=None, **env):
    return subprocess.run([sys.executable, "-m", "mlacore", *args], capture_output=True, text=True,
                          env=subprocess_env(plugin_site, **env), timeout=300)


def test_explain_json_lists_every_verdict(capsys):
    code = main(["backends", "explain", "--num-heads", "16", "--seq-len-q", "2", "--batch", "64",
                 "--kv-dtype", "fp8_e4m3", "--device", "cuda", "--capability", "9.0", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["problem"]["device"] == {"type": "cuda", "capability": [9, 0]}
    # what an H200 would pick under the default policy (fp8 cache from batch 64: our sm_90 kernels),
    # judged here from the installed packages when this machine has no H200
    assert data["chosen"] == "cute_dsl_mla"
    names = [v["backend"] for v in data["verdicts"]]
    assert names[:4] == ["cute_dsl_mla", "flashinfer_mla", "cutlass_mla", "reference"]


def test_default_policy_routes_h128_bf16_by_gpu_batch_and_length(capsys):
    """The built-in policy's H=128 bf16 rules (measured on an H200 only; twenty-fourth session): s_q=1 and 2 ours at
    every batch on capability 9.0 since mla-cute-dsl 0.2.19 (faster than fa3 also at the batches that fill its 66
    slots); s_q=4 ours up to batch 64; the same batch on a B200 (10.0) stays with FlashInfer, each with the policy's
    reason on our verdict."""
    cases = {(1, 16, 4096, "9.0"): "cute_dsl_mla", (1, 64, 1800, "9.0"): "cute_dsl_mla",
             (2, 66, 1000, "9.0"): "cute_dsl_mla", (1, 128, 1000, "9.0"): "cute_dsl_mla",
             (2, 128, 4096, "9.0"): "cute_dsl_mla", (1, 190, 9000, "9.0"): "cute_dsl_mla",
             (2, 400, 1000, "9.0"): "cute_dsl_mla", (4, 64, 4096, "9.0"): "cute_dsl_mla",
             (4, 65, 4096, "9.0"): "flashinfer_mla", (1, 16, 4096, "10.0"): "flashinfer_mla"}
    chosen, reasons = {}, {}
    for s_q, batch, kv_len, cap in cases:
        code = main(["backends", "explain", "--num-heads", "128", "--seq-len-q", str(s_q), "--batch", str(batch),
                     "--kv-len", str(kv_len), "--device", "cuda", "--capability", cap, "--json"])
        data = json.loads(capsys.readouterr().out)
        assert code == 0
        chosen[s_q, batch, kv_len, cap] = data["chosen"]
        reasons[s_q, batch, kv_len, cap] = " ".join(r for v in data["verdicts"] if v["backend"] == "cute_dsl_mla"
                                                    for r in v["reasons"])
    assert chosen == cases
    assert "batch=65 > max_batch=64" in reasons[4, 65, 4096, "9.0"]
    assert "capability=10.0 not in ['9.0']" in reasons[1, 16, 4096, "10.0"]


def test_default_policy_routes_tp_head_counts_bf16_to_ours_on_sm90(capsys):
    """The built-in rules for a bf16 cache at H=16 s_q 3/4, H=32 and H=64 (s_q 1-4; twenty-third session: ours at
    every batch and length on capability 9.0, where three H200 grids found fa3 ahead only at the batches that fill
    its slots); a B200 keeps FlashInfer, and H=16 s_q=5 has no rule for ours."""
    cases = {(32, 1, 55, 700, "9.0"): "cute_dsl_mla", (32, 1, 160, 700, "9.0"): "cute_dsl_mla",
             (64, 2, 140, 1200, "9.0"): "cute_dsl_mla", (64, 4, 500, 7000, "9.0"): "cute_dsl_mla",
             (16, 3, 140, 5000, "9.0"): "cute_dsl_mla", (16, 4, 1, 64, "9.0"): "cute_dsl_mla",
             (32, 2, 16, 4096, "10.0"): "flashinfer_mla", (16, 5, 16, 4096, "9.0"): "flashinfer_mla"}
    chosen = {}
    for heads, s_q, batch, kv_len, cap in cases:
        code = main(["backends", "explain", "--num-heads", str(heads), "--seq-len-q", str(s_q), "--batch", str(batch),
                     "--kv-len", str(kv_len), "--device", "cuda", "--capability", cap, "--json"])
        assert code == 0
        chosen[heads, s_q, batch, kv_len, cap] = json.loads(capsys.readouterr().out)["chosen"]
    assert chosen == cases


def test_explain_with_error_fallback_exits_1(tmp_path, capsys):
    pol = tmp_path / "p.toml"
    pol.write_text('[mla]\norder = ["flashinfer_mla"]\nfallback = "error"')
    code = main(["backends", "explain", "--num-heads", "16", "--device", "cpu", "--policy", str(pol)])
    assert code == 1
    assert "no backend takes this problem" in capsys.readouterr().out


def test_policy_check_ok_and_errors(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text('[mla]\norder = ["reference"]\n[backend.reference.options]\nchunk_tokens = 128')
    proc = run_cli("policy", "check", str(good))
    assert proc.returncode == 0 and "ok" in proc.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text('[mla]\norder = ["reference"]\n[backend.reference.options]\nchunk_token = 128')
    proc = run_cli("policy", "check", str(bad))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"mla: error: {bad}: backend.reference.options.chunk_token: unknown option (known: chunk_tokens)"
    typo = tmp_path / "typo.toml"
    typo.write_text('[mla]\norder = ["refrence"]')
    proc = run_cli("policy", "check", str(typo))
    assert proc.returncode == 2 and "mla.order[0]: unknown backend 'refrence'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_env_override_is_one_line():
    proc = run_cli("backends", "list", MLA_BACKENDS="reference,-x")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "mixes an exact list" in proc.stderr


def test_explain_bad_problem_is_one_line():
    proc = run_cli("backends", "explain", "--num-heads", "0", "--device", "cpu")
    assert proc.returncode == 2
    assert proc.stderr == "mla: error: --num-heads: must be at least 1, got 0\n"


def test_check_quick_passes_on_cpu():
    proc = run_cli("check", "--quick", "--device", "cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "12 passed, 0 failed" in proc.stdout


def test_check_unknown_backend():
    proc = run_cli("check", "--backend", "nope", "--device", "cpu")
    assert proc.returncode == 2 and "--backend: 'nope' is not installed" in proc.stderr


def test_check_passes_a_right_plugin_and_skips_what_it_cannot_take(plugin_site):
    proc = run_cli("check", "--quick", "--device", "cpu", "--backend", "chunked_reference", plugin_site=plugin_site)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "skip" in proc.stdout and "page_size=1 not in {16, 64}" in proc.stdout


def test_check_fails_a_wrong_backend(plugin_site):
    proc = run_cli("check", "--quick", "--device", "cpu", "--backend", "drops_last_token", plugin_site=plugin_site)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout and "0 passed, 12 failed" in proc.stdout
