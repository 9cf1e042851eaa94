"""cachegen offered to other serving systems, each as an optional extra of the distribution.

``cachegen.integrations.lmcache`` (``pip install 'cachegen[lmcache]'``): a serde of LMCache's
multiprocess L2 adapters. Nothing else in the library imports an integration (the layer
contract), and an integration imports its system only when it is used.
"""
