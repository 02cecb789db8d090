"""The bundled default model's making: `mlaquant train` (`train`) and its corpus, Python standard-library files
split by file into disjoint sets (`corpus`). Beside the data flow rather than on it: it produces the checkpoint
(package data in `mlaquant/assets/default_model/`, which `mlaquant.modeling.loader` loads by default) and the
held-out splits in `calib/data/`.
"""
