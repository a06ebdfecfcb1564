"""`dflash-mac serve`: the OpenAI-compatible server — app factory, routes, responses, request
schema, the generation worker, metrics and the command."""
