"""What the transform codecs share (tcq here, kvtc and turboquant in the lab): the
PCA basis and bit allocation, Lloyd-Max quantizers, bit packing, the model file container,
the KVTC basis and the rotary tables.
"""
