"""Invertible key/value transforms: the RoPE-commuting family, Woodbury-parametrised general matrices, Hadamard.

Learning them is :mod:`kvsqueeze.calibrate.invertible`; folding them into a model is
:mod:`kvsqueeze.calibrate.fold`; a cache applies unfolded ones with :mod:`kvsqueeze.cache.codecs_transform`.
"""
