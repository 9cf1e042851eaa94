"""CacheGen (SIGCOMM 2024): the codec, its encoder and decoder (coded and packed
forms), frames, quantizers, the numba kernels, the profile and its size estimates.
"""
