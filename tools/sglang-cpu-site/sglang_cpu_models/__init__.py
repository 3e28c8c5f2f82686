"""The one model family the CPU tests serve, as an SGLang "external model package".

With ``SGLANG_EXTERNAL_MODEL_PACKAGE=sglang_cpu_models`` SGLang's model registry imports this
package instead of all of ``sglang.srt.models`` (150-odd modules, most of which fail on CPU after
costing their import): a scheduler on a 2-core machine starts about a minute sooner.
"""
