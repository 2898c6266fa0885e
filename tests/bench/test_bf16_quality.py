"""benchmarks/bf16_quality.py (issue #35 part 2) in its dry run on the generated tiny model, as a user runs
it: a served llmbus bf16 row against transformers float32, and the perplexity through the decode path, whose
float32 figure must be transformers float32's on the same tokens (what makes the bf16 ratio mean anything)."""

from __future__ import annotations

import json

import pytest



def test_dry_run_measures_both_parts(dry_run, tiny_model_dir):
    # the session's tiny demo model: what the dry run would otherwise build again, the same bytes
    done, result = dry_run("benchmarks/bf16_quality.py", "--model-id", str(tiny_model_dir))
    assert result["dry_run"] is True
    (row,) = result["answers"].values()
    assert row["questions"] == 3 and 0 <= row["identical"] <= 3 and len(row["answers"]) == 3
    assert row["prompt_tokens_match"], (row["prompt_tokens"], result["reference"]["prompt_tokens"])
    ppl = result["perplexity"]
    assert set(ppl) == {"llmbus f32 kv auto", "llmbus bf16 kv auto", "transformers f32", "transformers bf16"}
    f32 = ppl["llmbus f32 kv auto"]
    assert f32["tokens"] == ppl["transformers f32"]["tokens"] == 40 - 8 - 1
    assert f32["decode"] == pytest.approx(ppl["transformers f32"]["prefill"], rel=1e-3)
    assert f32["prefill"] == pytest.approx(ppl["transformers f32"]["prefill"], rel=1e-3)
    assert ppl["llmbus bf16 kv auto"]["decode_vs_f32"] > 0
    assert {"perplexity: llmbus bf16 decode <= 1.01x f32"} <= set(result["targets"])
    # the JSON line comes last, after the table and the verdicts
    assert json.loads(done.stdout.splitlines()[-1])["dry_run"] is True
    assert "decode ppl" in done.stdout
