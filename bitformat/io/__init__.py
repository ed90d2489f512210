"""Reading and writing files: GGUF (``gguf``), safetensors (``safetensors``), the opened model
(``model``), atomic file and folder writers (``atomic``, ``atomic_folder``), read-once file
mappings (``mapping``) and the Hugging Face cache (``hf_cache``)."""
