"""`mlaquant bench`: decode step time and cache memory against a baseline in the same run (`decode`), the
decode-attention call per path against the machine bound (`attention`), the Triton kernels on a CUDA GPU
(`kernels`) and the GPU acceptance run (`gpu`). The top floor of the data flow: it may import every other
package, `mlaquant.calib` included (`bench gpu` calibrates), and nothing but `mlaquant.cli` (by module name)
refers to it (tests/test_layering.py).
"""
