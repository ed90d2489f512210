"""Tokenizers as GGUF files carry them: byte-level BPE (``bpe``) with llama.cpp's
pre-tokenizers (``pretokenize``), SentencePiece vocabularies (``spm``) and chat templates
(``chat_template``)."""
