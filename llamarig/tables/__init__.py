"""Tables of the world llamarig plans for, and pure rules over them, importing nothing of llamarig:
GPUs and CUDA (`hardware`), distributions (`platform`), packages (`packages`), llama-server's
options (`llama_args`), and how outside text is shown (`text`)."""
