"""The exploration-throughput benchmark runs end to end at tiny size (the real figures
need a GPU; this keeps the script from rotting)."""

from tests.helpers import load_script


def test_bench_explore_prints_a_ratio_table(capsys):
    module = load_script("bench_explore")
    module.main(["--tiny", "--device", "cpu", "--repeats", "1", "--batch", "2",
                 "--modes", "bf16,nvfp4:reference,fp8:reference"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "ms per forward" not in line]
    assert [r.split("|")[1].strip() for r in rows] == ["bf16", "nvfp4:reference", "fp8:reference",
                                                       "update (bf16 LoRA fwd+bwd)"]
    assert rows[0].split("|")[4].strip() == "1.00x"  # bf16 against itself
    assert "exploration copy: nvfp4 via reference" in out
