"""The REST bridge: OpenAI's API over the gateway core, split as vLLM splits its OpenAI server.

protocol.py  request models, the fields refused, the error shape, REST -> GenerationSpec
serving.py   a request in, GatewayCore calls, OpenAI's answers (whole or as events) out
routes.py    the FastAPI app: routes, the API-key and body-size guard, error handlers
"""
