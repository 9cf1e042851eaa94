"""tcq, the project's transform coder: the codec, its model file, coding, encoder and
decoder, kernels (numba and the C synthesis kernel), packed form, prediction, refinement,
levels and size estimates.
"""
