"""Calibrated KV-cache quantization: SKVQ (channel reordering, clip search, 1.5-bit values) and KVQuant-style
pre-RoPE keys with sparse outliers, producing artifact directories that ``QuantizedCache`` and ``--kv`` load.

    from kvsqueeze.calibrate import CalibrationSettings, calibrate, corpus_samples
    data = corpus_samples(corpus, tokenizer, samples=4, length=512)      # the corpus tail, disjoint from eval
    art = calibrate(model, data, CalibrationSettings(method="skvq"))
    path = art.save("artifacts")                                          # artifacts/<name named by settings>
    cache = kvsqueeze.QuantizedCache(model.config, str(path))
"""

from ..artifact import Artifact, Side, is_artifact_dir, load_artifact
from .api import METHODS, CalibrationSettings, calibrate, calibrate_activations
from .collect import collect, corpus_samples, generated_samples
from .fold import fold_value_permutation

__all__ = ["METHODS", "Artifact", "CalibrationSettings", "Side", "calibrate", "calibrate_activations", "collect",
           "corpus_samples", "fold_value_permutation", "generated_samples", "is_artifact_dir", "load_artifact"]
