"""The CLIP models: our tiny CLIP and adapters for Hugging Face and open_clip models, behind one interface.

* ``features``: the interface (``ImageFeatures``, ``TextFeatures``) and helpers on its outputs.
* ``tiny``: TinyCLIP, trained from scratch [ours].
* ``hf``: a ``transformers`` ``CLIPModel`` and its tokenizer behind the interface.
* ``openclip``: an open_clip model and its tokenizer behind the interface (+ the packaged ``reprlab-tiny-vit``).
* ``build``: ``model.arch`` -> model and tokenizer (the only module that knows every architecture).
* ``embed``: batched, eval-mode, gradient-free embeddings of images and captions.
* ``run_model``: what a run saves of its tokenizer; the model, tokenizer and config rebuilt from a run folder.

An export to open_clip or transformers formats belongs here, beside the adapter of that format.
"""
