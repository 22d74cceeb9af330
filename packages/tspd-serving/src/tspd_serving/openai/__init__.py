"""OpenAI's request and response bodies, shared by every tspd front door that speaks them.

The router (``tspd_router``) and a serving node (``tspd_engine.node``, its ``/v1/*`` routes)
both parse ``/v1/completions`` and ``/v1/chat/completions`` bodies with :mod:`.api` (chat
templates through :mod:`.chat`), check prompts against the model's limits (:mod:`.limits`),
turn token ids into streamed text with stop strings (:mod:`.text`) and build OpenAI's response
bodies and stream chunks (:mod:`.shape`); so a node answers a request exactly as the router
would. Errors are :class:`.errors.ApiError`\\ s, which carry their HTTP status and OpenAI's
error body. Pure code: safe on any thread, no I/O.
"""
