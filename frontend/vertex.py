"""Google Vertex AI's prediction route, as TGI serves it: ``POST /vertex``, and the routes Vertex names in
``AIP_PREDICT_ROUTE`` and ``AIP_HEALTH_ROUTE`` (frontend/config.py; TGI's ``google`` build reads them).

The body is ``{"instances": [...]}``, each instance a TGI generate request (``inputs`` and ``parameters``)
or a chat request (``messages``, with OpenAI's fields); the answer is ``{"predictions": [text, ...]}``,
one generated text per instance, in order. The instances run concurrently. Where TGI differs:
- TGI takes only ``max_new_tokens`` and ``seed`` of a generate instance's parameters and samples; here
  every parameter is validated and honoured as on ``/generate``, and an instance samples unless it sets
  ``do_sample`` (TGI's default for this route).
- TGI answers any failed generation with 500 "Incomplete generation"; here each error has its kind's status
  and text (a 422 names the instance).
"""

from __future__ import annotations

import time

from aiohttp import web

from llmbus.bus.settings import SettingsError
from llmbus.frontend.errors import ApiError, validation_error
from llmbus.frontend.generation import run_all
from llmbus.frontend.middleware import ROUTE_ALIASES
from llmbus.frontend.openai_requests import parse_chat, read_json_object
from llmbus.frontend.openai_routes import Choice, Job, chat_format, chat_prompt
from llmbus.frontend.state import STATE, FrontendState, json_response
from llmbus.frontend.validation import generate_request

PATH = "/vertex"


def _instance_job(state: FrontendState, index: int, instance) -> tuple[Job, frozenset[str] | None]:
    """What instance ``index`` generates: its prompt and parameters (a chat instance through the model's
    template), and for a chat instance the chat format's markers its text keeps (None: a generate one)."""
    if isinstance(instance, dict) and "messages" in instance:
        fmt = chat_format(state)
        chat = parse_chat(instance, state.limits, 1, state.sampling_defaults, fmt)
        return Job(index, index, chat_prompt(state, chat), chat.params, add_special_tokens=False), fmt.markers
    if not isinstance(instance, dict) or "inputs" not in instance:
        raise validation_error("an instance must be a generate request (`inputs`) or a chat request (`messages`)")
    request = generate_request(instance, struct="GenerateVertexInstance")
    p = request.parameters
    if (instance.get("parameters") or {}).get("do_sample") is not False:  # TGI samples this route's requests
        p.do_sample = True
    if p.best_of not in (None, 1):
        raise validation_error("`best_of` must be 1: one prediction per instance")
    p = state.sampling_defaults.fill_tgi(p)
    return Job(index, index, request.inputs, p, add_special_tokens=True,
               echo=request.inputs if p.return_full_text else ""), None


def _prediction(choice: Choice, chat: bool) -> str:
    """A chat instance's answer as the chat route shows it (a matched stop sequence cut); a generate
    instance's as ``/generate`` does (the stop sequence kept, the prompt first with ``return_full_text``)."""
    return choice.visible_text() if chat else choice.job.echo + choice.gen.generated_text


async def vertex(request: web.Request) -> web.Response:
    start, arrival = time.monotonic(), time.time()
    state = request.app[STATE]
    body = read_json_object(await request.read(), "VertexRequest")
    instances = body.get("instances")
    if not isinstance(instances, list) or not instances:
        raise validation_error("`instances` must be a non-empty array of generate or chat requests",
                               param="instances")
    jobs = []
    for index, instance in enumerate(instances):
        try:
            jobs.append(_instance_job(state, index, instance))
        except ApiError as e:
            raise e.at(f"instances[{index}]") from None  # which of the instances, as a client sends many
    gens = await state.generator.prepare_all([(job.text, job.params, job.add_special_tokens) for job, _ in jobs],
                                             start, arrival, name="instances")
    await run_all(gens)
    return json_response({"predictions": [_prediction(Choice(job, gen, markers or frozenset()), markers is not None)
                                          for (job, markers), gen in zip(jobs, gens)]})


def setup_vertex_routes(app: web.Application, predict_route: str | None, health_route: str | None,
                        health) -> None:
    """/vertex, and Vertex's own paths for it and for ``health`` where its environment names them."""
    app.router.add_post(PATH, vertex)
    served = {resource.canonical for resource in app.router.resources()}
    for name, path in (("AIP_PREDICT_ROUTE", predict_route), ("AIP_HEALTH_ROUTE", health_route)):
        if path and path not in (PATH, "/health") and path in served:
            raise SettingsError([f"`{name.lower()}` names a route llmbus serves already. Given: {path}"])
    aliases = {}
    if predict_route and predict_route != PATH:
        app.router.add_post(predict_route, vertex)
        aliases[predict_route] = PATH
    if health_route and health_route != "/health":
        app.router.add_get(health_route, health)
        aliases[health_route] = "/health"
    app[ROUTE_ALIASES] = aliases
