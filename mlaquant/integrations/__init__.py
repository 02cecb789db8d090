"""mlaquant and other software: transformers' `Cache` over a plan's codecs (`hf`), the lm-evaluation-harness
model (`harness`), a plan exported for vLLM / SGLang (`export`), other engines' cache settings (`engines`)
checked by executing their released code (`engine_check`, wheels fetched by `distributions`) and llama.cpp as a
peer engine (`llamacpp`). At the end of the data flow: they take a model and a plan (`mlaquant.modeling`,
`mlaquant.runtime`) out to other engines, or bring those engines in as the sweep's rows.
"""
