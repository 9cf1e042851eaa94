"""Builders of the model directories ``cachegen.models`` names: GGUF conversion of the
embedded models (:mod:`.gguf`) and the random-weight tiny models (:mod:`.tiny`). Each writes
a plain Hugging Face directory into the directory it is given; ``cachegen.models`` verifies
it and renames it into place."""
