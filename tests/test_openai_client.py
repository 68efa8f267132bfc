#!/usr/bin/env python3
"""The `openai` Python client (PyPI) against `moeserve serve`: completions, chat completions,
both streamed, usage right. Unmodified client, base_url http://127.0.0.1:PORT/v1, api_key "x".

Run from anywhere: `python3 tests/test_openai_client.py [-v]`; needs `pip install openai`.
Last line "N passed, M failed"; exit status 0 only when nothing failed.
"""
import os
import sys

sys.dont_write_bytecode = True  # keep tests/ free of __pycache__
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_http as th  # noqa: E402  (shared server harness)
from test_http import check, short  # noqa: E402

try:
    import openai
except ImportError:
    openai = None

PROMPT = "Question: Tom has 3 apples and buys 4 more. How many apples does he have?\nAnswer:"
MESSAGES = [{"role": "system", "content": "Answer with a number."},
            {"role": "user", "content": "Tom has 3 apples and buys 4 more. How many now?"}]


def run(srv):
    client = openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % srv.port, api_key="x", max_retries=0, timeout=60)
    models = client.models.list()
    ids = [m.id for m in models.data]
    check("openai: models.list() returns a model", len(ids) >= 1, ids)
    model = ids[0] if ids else "default"

    # completions
    c = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    text = c.choices[0].text
    check("openai: completions.create text", isinstance(text, str) and c.object == "text_completion", short(str(c)))
    check("openai: completions finish_reason length", c.choices[0].finish_reason == "length", c.choices[0].finish_reason)
    u = c.usage
    check("openai: completions usage (completion 8, total = prompt + completion)",
          u is not None and u.completion_tokens == 8 and u.prompt_tokens > 0
          and u.total_tokens == u.prompt_tokens + u.completion_tokens, u)
    native = srv.post("/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                                       "ignore_eos": True}}).json()
    if native:
        check("openai: completions text and prompt_tokens == /generate's",
              text == native["text"] and u.prompt_tokens == native["meta_info"]["prompt_tokens"],
              "%r vs %r" % (text, native["text"]))

    # completions, streamed, with and without usage
    for include_usage in (False, True):
        kw = {"stream_options": {"include_usage": True}} if include_usage else {}
        pieces, finish, usage, empty = [], None, None, 0
        for chunk in client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True}, **kw):
            if chunk.choices:
                pieces.append(chunk.choices[0].text or "")
                finish = chunk.choices[0].finish_reason or finish
            else:
                empty += 1
            if chunk.usage is not None:
                usage = chunk.usage
        tag = "openai: completions stream%s" % (" with include_usage" if include_usage else "")
        check("%s: deltas concatenate to the non-streamed text" % tag, "".join(pieces) == text,
              "%r vs %r" % ("".join(pieces), text))
        check("%s: finish_reason length" % tag, finish == "length", finish)
        if include_usage:
            check("%s: usage == non-streamed usage" % tag, usage is not None
                  and (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)
                  == (u.prompt_tokens, u.completion_tokens, u.total_tokens), usage)
        else:
            check("%s: no usage chunk" % tag, empty == 0 and usage is None, "%d empty chunks, usage %s" % (empty, usage))

    # chat
    cc = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
    msg = cc.choices[0].message
    check("openai: chat.completions.create message", cc.object == "chat.completion" and msg.role == "assistant"
          and isinstance(msg.content, str), short(str(cc)))
    cu = cc.usage
    check("openai: chat usage (total = prompt + completion, completion <= 8)",
          cu is not None and 0 < cu.completion_tokens <= 8 and cu.total_tokens == cu.prompt_tokens + cu.completion_tokens,
          cu)
    for include_usage in (False, True):
        kw = {"stream_options": {"include_usage": True}} if include_usage else {}
        pieces, roles, finish, usage, empty = [], [], None, None, 0
        for chunk in client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0,
                                                    stream=True, **kw):
            if chunk.choices:
                d = chunk.choices[0].delta
                if d.role:
                    roles.append(d.role)
                pieces.append(d.content or "")
                finish = chunk.choices[0].finish_reason or finish
            else:
                empty += 1
            if chunk.usage is not None:
                usage = chunk.usage
        tag = "openai: chat stream%s" % (" with include_usage" if include_usage else "")
        check("%s: role assistant first" % tag, roles[:1] == ["assistant"], roles)
        check("%s: deltas concatenate to the non-streamed content" % tag, "".join(pieces) == msg.content,
              "%r vs %r" % ("".join(pieces), msg.content))
        check("%s: finish_reason == non-streamed" % tag, finish == cc.choices[0].finish_reason,
              "%s vs %s" % (finish, cc.choices[0].finish_reason))
        if include_usage:
            check("%s: usage == non-streamed usage" % tag, usage is not None
                  and (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)
                  == (cu.prompt_tokens, cu.completion_tokens, cu.total_tokens), usage)
        else:
            check("%s: no usage chunk" % tag, empty == 0 and usage is None, "%d empty chunks, usage %s" % (empty, usage))

    # logprobs through the client
    c = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    check("openai: completions logprobs 2", lp is not None and len(lp.token_logprobs) == 4 and len(lp.tokens) == 4,
          short(str(lp)))
    cc = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
                                        top_logprobs=2)
    lp = cc.choices[0].logprobs
    check("openai: chat logprobs with top_logprobs 2",
          lp is not None and lp.content is not None and len(lp.content) == cc.usage.completion_tokens
          and all(len(e.top_logprobs) == 2 for e in lp.content), short(str(lp)))

    # an error comes back as the client's exception type
    try:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=-1)
        check("openai: max_tokens -1 raises BadRequestError", False, "no exception")
    except openai.BadRequestError:
        check("openai: max_tokens -1 raises BadRequestError", True)
    except openai.APIError as e:
        check("openai: max_tokens -1 raises BadRequestError", False, "%s: %s" % (type(e).__name__, e))


def main(argv):
    th.VERBOSE = "-v" in argv
    if openai is None:
        check("the openai package is installed (pip install openai)", False,
              "import openai failed; install it with `pip install openai` to run these tests")
        print(th.R.summary())
        return 1
    if not os.access(th.BIN, os.X_OK):
        check("binary %s exists" % th.BIN, False, "build it first (make)")
        print(th.R.summary())
        return 1
    srv = th.Server("openai")
    th.with_server(srv, [(run, ())])
    print(th.R.summary())
    return 0 if th.R.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
