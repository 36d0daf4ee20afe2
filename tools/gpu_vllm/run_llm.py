"""One vLLM (0.32.0 or 0.33.0, as staged) offline-generation scenario on the GPU (pure-Python vLLM, Triton/native kernels).

usage: python3 run_llm.py SCENARIO          (env: TINY=/tmp/tiny, T_LAUNCH=<epoch s>, EXTRA='{json LLM kwargs}')
scenarios:
  plain_v1      tiny dense Qwen3, model runner V1 forced (VLLM_USE_V2_MODEL_RUNNER=0)
  plain         tiny dense Qwen3, default model runner
  hybrid        tiny dense hybrid Qwen3_5ForCausalLM (GDN x3 + attention x1), V1 forced
  dflash        hybrid + speculative method "dflash" (draft DFlashDraftModel), V1 forced, stats on
  hybrid_const / dflash_const   the same on the constant-output pair (draft must be 100% accepted)
  hybrid_default / dflash_default   hybrid / dflash with the default model runner (V2 in 0.32.0 and 0.33.0; informational)
Prints 'RESULT {json}' (token ids, timings, spec-decode metrics) as its last line.
"""
import json
import os
import sys
import time

T0 = float(os.environ.get("T_LAUNCH") or time.time())
scen = sys.argv[1]
T = os.environ.get("TINY", "/tmp/tiny")
if scen in ("plain_v1", "hybrid", "dflash", "hybrid_const", "dflash_const"):
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
for k, v in dict(VLLM_ENABLE_V1_MULTIPROCESSING="0",  # engine core in this process: no 2nd vLLM import
                 VLLM_NO_USAGE_STATS="1", VLLM_DO_NOT_TRACK="1", HF_HUB_OFFLINE="1",
                 TRANSFORMERS_OFFLINE="1", VLLM_USE_FLASHINFER_SAMPLER="0").items():
    os.environ.setdefault(k, v)

import torch  # noqa: E402

t_torch = time.time() - T0
from vllm import LLM, SamplingParams  # noqa: E402

t_import = time.time() - T0
print(f"torch {torch.__version__} {torch.cuda.get_device_name(0)}  import torch {t_torch:.1f}s vllm {t_import:.1f}s",
      flush=True)

common = dict(enforce_eager=True, dtype="bfloat16", seed=0, max_model_len=1024, max_num_seqs=8,
              gpu_memory_utilization=0.08, kv_cache_memory_bytes=1 << 30,  # fixed KV budget: no memory profiling
              compilation_config={"custom_ops": ["none"]}, attention_config={"backend": "TRITON_ATTN"})
hyb = dict(additional_config={"gdn_prefill_backend": "triton"})  # 'auto' picks FlashInfer on SM90
const = "_const" if scen.endswith("_const") else ""
if scen in ("plain", "plain_v1"):
    kw = dict(model=f"{T}/qwen3")
elif scen in ("hybrid", "hybrid_const", "hybrid_default"):
    kw = dict(model=f"{T}/qwen35{const}", **hyb)
elif scen in ("dflash", "dflash_const", "dflash_default"):
    kw = dict(model=f"{T}/qwen35{const}", **hyb, disable_log_stats=False,
              speculative_config={"method": "dflash", "model": f"{T}/dflash{const}", "num_speculative_tokens": 3,
                                  "attention_backend": "TRITON_ATTN"})  # draft needs non-causal attn: not FA
else:
    raise SystemExit(f"unknown scenario {scen}")
kw = {**common, **kw, **json.loads(os.environ.get("EXTRA") or "{}")}
print("LLM kwargs:", kw, flush=True)
llm = LLM(**kw)
t_ready = time.time() - T0
print(f"engine ready {t_ready:.1f}s after launch", flush=True)

prompts = ["The quick brown fox", "def f(x):", "1 2 3 4", "Speculative decoding drafts tokens"]
sp = SamplingParams(temperature=0.0, max_tokens=int(os.environ.get("MAX_TOKENS", "48")), ignore_eos=True)
t1 = time.time()
outs = llm.generate(prompts, sp, use_tqdm=False)
t_gen1 = time.time() - t1
t1 = time.time()
outs2 = llm.generate(prompts, sp, use_tqdm=False)  # 2nd pass: Triton kernels already compiled
t_gen2 = time.time() - t1
ids = [list(o.outputs[0].token_ids) for o in outs]
repeat_equal = ids == [list(o.outputs[0].token_ids) for o in outs2]  # 2nd pass may hit the prefix cache
for o in outs:
    print(repr(o.prompt), "->", repr(o.outputs[0].text[:60]), len(o.outputs[0].token_ids), "toks")
ntok = sum(len(x) for x in ids)
print(f"GENERATE OK scen={scen} 1st {t_gen1:.2f}s  2nd {t_gen2:.2f}s ({ntok / t_gen2:.0f} tok/s)", flush=True)

spec = {}
try:
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            spec[m.name.split(":")[1]] = getattr(m, "values", None) or getattr(m, "value", None)
except Exception as e:  # stats disabled
    spec["error"] = repr(e)[:200]
if "spec_decode_num_draft_tokens" in spec:
    d, a, n = (spec["spec_decode_num_draft_tokens"], spec["spec_decode_num_accepted_tokens"],
               spec["spec_decode_num_drafts"])
    spec["acceptance_rate"] = round(a / d, 4) if d else None
    spec["mean_acceptance_length"] = round(1 + a / n, 3) if n else None
    print("SPEC", json.dumps(spec), flush=True)
runner = getattr(getattr(llm.llm_engine, "vllm_config", None), "use_v2_model_runner", None)
print("RESULT " + json.dumps(dict(scen=scen, ids=ids, repeat_equal=repeat_equal, runner_v2=runner,
                                  import_s=round(t_import, 1),
                                  ready_s=round(t_ready, 1), gen1_s=round(t_gen1, 2), gen2_s=round(t_gen2, 2),
                                  spec=spec)), flush=True)
os._exit(0)  # skip slow interpreter teardown
