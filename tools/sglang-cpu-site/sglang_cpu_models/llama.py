"""SGLang's own Llama, registered under its own name (``EntryClass``)."""

from sglang.srt.models.llama import LlamaForCausalLM

EntryClass = LlamaForCausalLM
