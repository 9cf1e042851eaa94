"""The shared bitstream and entropy coding: the versioned header and frames, rANS,
probability tables and their providers, and the codec threads.
"""
