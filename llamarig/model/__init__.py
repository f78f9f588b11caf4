"""The model: how it is named (`reference`: a Hugging Face reference's parts), resolved on the
Hub (`hub`) into pinned files, which models a rig serves (`catalog`), its files on a host and
their shards (`files`), its GGUF header as llama.cpp reads it (`gguf`), and that header as a
compact record (`header_record`). models.lock.yml, which keeps them, is `config.lock`; the
header found by URL, local copy or host is `planner.header`."""
