"""Norm-IC: does an embedding's squared norm track the information content of its text?

Paper: Amigó, Ghajari, Benito-Santos, De La Fuente Rodríguez, *On the Correspondence between the Squared
Norm and Information Content in Text Embeddings*, Findings of EMNLP 2025 (only the abstract is known to us).

What is the paper's [known, abstract]: the word-level test of ‖v‖² against IC for static and contextual
embeddings under several subword composition functions; the constant-entropy-rate (CER) length test; the
remark that BERT's CLS and LLaMA's EOS converge towards a fixed point. The information-theoretic
composition family is Amigó et al. (2022, Computational Linguistics 48(4)), re-implemented from its
published formulas. Everything else (the scaled-average readings a/b/c, the vocabulary sampling, the IC
sources, the sufficient-condition diagnostics, the length protocol) is [ours] and labelled so.

Modules (one concept each): ``ic`` (information content sources), ``vocab`` (frequency-band sampling),
``static`` (GloVe, SGNS, input tables), ``extract`` (batched per-layer HF states), ``compose``
(composition functions), ``normalize`` (centring/whitening on a disjoint fit vocabulary), ``stats``
(correlations with bootstrap CIs), ``conditions`` (sufficient-condition diagnostics), ``length`` (CER and
fixed point, CIs over documents), ``nulls`` (random-vector, piece-count and shuffled-IC baselines, and which
correlations survive them [ours]), (models usable offline are checked before any work by ``reprlab.models.hf.check_model_available``),
``recipe`` (the run entry).
"""
