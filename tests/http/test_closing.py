"""A tight max_tokens under response_format through the server: the OpenAI SDK's parse, which raises
on a cut answer, takes every one (generation/constrain/closing.py closes them)."""
from __future__ import annotations

import openai

from tests.generation.test_closing import TICKETS


def test_the_sdks_parse_takes_a_tightly_budgeted_answer(server):
    from pydantic import BaseModel

    class Contact(BaseModel):
        email: str

    class Ticket(BaseModel):
        category: str
        urgency: int
        summary: str
        steps: list[str]
        contact: Contact

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    for ticket in TICKETS[:4]:
        answer = client.chat.completions.parse(
            model="smollm2-135m", max_tokens=40, temperature=0, response_format=Ticket,
            messages=[{"role": "user", "content": "Summarize this support ticket: " + ticket}])
        assert isinstance(answer.choices[0].message.parsed, Ticket)
        assert answer.choices[0].finish_reason == "stop" and answer.usage.completion_tokens <= 40
        assert answer.model_extra["edgellm"]["constraint_met"] is True
