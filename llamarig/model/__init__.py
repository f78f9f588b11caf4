"""The model: how it is named (`reference`: a Hugging Face reference's parts), resolved on the
Hub (`hub`) into the pinned files that `lock` keeps in models.lock.yml with their headers
(`header_record`), its files on a host and their shards (`files`), and its GGUF header, read by URL,
from a local copy or from the host and kept on this machine (`header`)."""
