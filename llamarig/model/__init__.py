"""The model: how it is named (`reference`: a Hugging Face reference's parts), resolved on the
Hub (`hub`) into the pinned files that `lock` keeps in models.lock.yml with their headers
(`header_record`), split into shards (`shards`), and how its GGUF header is kept on this
machine (`header_cache`)."""
