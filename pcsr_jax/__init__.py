"""pcsr-jax: online test-time adaptation of Vision Transformers in JAX.

A pure-JAX/Flax implementation of PCSR (Progressive Conditioned Scale-Shift
Recalibration of self-attention) with the TENT, SAR and Source baselines, on a
Vision Transformer whose parameters map one-to-one onto timm's.
"""

__version__ = "0.1.0"
