"""mlaquant's vLLM plugin: a calibrated plan served inside vLLM, each layer's planned codes in vLLM's paged cache.

    plugin    the entry point vLLM loads in every process (`register`), the supported vLLM versions, where the
              plan comes from; imports no vLLM until a plan is asked for
    backend   the plan as a vLLM MLA attention backend (imported by vLLM only)
    pages     one layer's planned rows in vLLM's pages: write, read, decode (no vLLM import; tested without vLLM)
    run       `python -m mlaquant.integrations.vllm.run`: vLLM on token prompts → JSON (the live tests, the bench)
"""
