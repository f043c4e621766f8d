"""ppojax.agents, host side: tool schemas (TRL's), tool-call parsers, running calls (errors, timeouts and malformed
calls as observations, counted), environments (TRL-style adapter, the protocol, async), refusals, loading
'module:name', and the tools rendered by a real chat template (SmolLM2's tokenizer). Pure Python: no JAX."""
import asyncio
import json
import textwrap
import threading
import time
from typing import Literal, Optional

import pytest

from ppojax import agents
from ppojax.agents import (CHATML_TOOLS_TEMPLATE, Environment, EnvironmentFactory, MalformedCall, ParsedMessage, Step,
                           ToolCall, ToolEnvironment, ToolRunner, check_tool_template, final_reward,
                           get_tool_call_parser, load_environment, load_tool_call_parser, load_tools, parse_hermes,
                           parse_llama3, register_tool_call_parser, reset_environment, step_all, step_environment,
                           supports_tool_calling, tool_schema, tool_schemas)
from ppojax.errors import ConfigError, EnvironmentCallError
from ppojax.tasks.calculator import calculate
from ppojax.trainer.prompt_sources import arithmetic_split


# ------------------------------------------------------------------------------------------------ tools used below
def multiply(a: int, b: float = 2.0) -> float:
    """
    Multiply two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a * b


def search(query: str, limit: Optional[int] = None, mode: Literal["fast", "slow"] = "fast",
           tags: list[str] = None) -> str:
    """Search the corpus.

    Args:
        query: Words to look for.
        limit: At most this many results.
        mode: How hard to look (choices: ["fast", "slow"])
        tags: Tags to filter by.

    Returns:
        The hits, one a line.
    """
    return f"{query}:{limit}:{mode}"


async def fetch(url: str) -> str:
    """Fetch a page.

    Args:
        url: The address.
    """
    await asyncio.sleep(0)
    return f"<html>{url}</html>"


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: The numerator.
        b: The denominator.
    """
    return a / b


def hang(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke up"


async def hang_async(seconds: float) -> str:
    """Sleep without blocking.

    Args:
        seconds: How long.
    """
    await asyncio.sleep(seconds)
    return "woke up"


class Counter:
    """A TRL-style environment: reset(**row), public methods are tools, get_reward() reads the state."""

    def __init__(self):
        self.total = 0
        self.target = None

    def reset(self, target: int = 3, **row) -> str:
        self.total, self.target = 0, target
        return f" Reach {target}."

    def add(self, amount: int) -> str:
        """Add to the running total.

        Args:
            amount: How much to add.
        """
        self.total += amount
        return f"total={self.total}"

    def get_reward(self) -> float:
        return 1.0 if self.total == self.target else 0.0

    def _helper(self):  # private: not a tool
        return None


# Expected schemas: transformers.utils.get_json_schema's output, the function TRL's code uses (GRPOTrainer passes
# `tools` to apply_chat_template, which calls it; trl/generation/vllm_client.py calls it directly). Produced once in
# the TRL 1.12 environment (transformers 5.24) and written here.
EXPECTED = {
    "multiply": {"type": "function", "function": {
        "name": "multiply", "description": "Multiply two numbers.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "description": "The first number."},
            "b": {"type": "number", "description": "The second number."}}, "required": ["a"]},
        "return": {"type": "number"}}},
    "search": {"type": "function", "function": {
        "name": "search", "description": "Search the corpus.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "Words to look for."},
            "limit": {"type": "integer", "nullable": True, "description": "At most this many results."},
            "mode": {"type": "string", "enum": ["fast", "slow"], "description": "How hard to look"},
            "tags": {"type": "array", "items": {"type": "string"}, "description": "Tags to filter by."}},
            "required": ["query"]},
        "return": {"type": "string", "description": "The hits, one a line."}}},
    "fetch": {"type": "function", "function": {
        "name": "fetch", "description": "Fetch a page.",
        "parameters": {"type": "object", "properties": {"url": {"type": "string", "description": "The address."}},
                       "required": ["url"]},
        "return": {"type": "string"}}},
    "add": {"type": "function", "function": {
        "name": "add", "description": "Add to the running total.",
        "parameters": {"type": "object",
                       "properties": {"amount": {"type": "integer", "description": "How much to add."}},
                       "required": ["amount"]},
        "return": {"type": "string"}}},
}


# ------------------------------------------------------------------------------------------------------- schemas
@pytest.mark.parametrize("fn", [multiply, search, fetch, Counter().add], ids=lambda f: f.__name__)
def test_schema_is_trls(fn):
    assert tool_schema(fn) == EXPECTED[fn.__name__]


def test_schema_refusals_name_the_tool_and_the_fix():
    def no_hint(a):
        """Doc.

        Args:
            a: A thing.
        """

    def no_doc(a: int):
        pass

    def undocumented_arg(a: int, b: int):
        """Does a thing.

        Args:
            a: A thing.
        """

    for fn, words in [(no_hint, "type hint"), (no_doc, "docstring"), (undocumented_arg, "'b'")]:
        with pytest.raises(ConfigError, match=fn.__name__) as err:
            tool_schema(fn)
        assert words in str(err.value) and "Fix:" in str(err.value)
    with pytest.raises(ConfigError, match=r"tool 42 is not a function \(its type is int\)"):
        tool_schema(42)
    with pytest.raises(ConfigError, match="is a class"):
        tool_schema(Counter)

    def other():
        """Another.

        Args:
            a: A.
        """
    other.__name__ = "multiply"
    with pytest.raises(ConfigError, match="two tools are named 'multiply'"):
        tool_schemas([multiply, other])


# ------------------------------------------------------------------------------------------------------- parsers
def test_hermes_one_and_several_calls():
    one = parse_hermes('<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>')
    assert one == ParsedMessage("", (ToolCall("multiply", {"a": 3, "b": 4}),))
    text = ('Let me look.\n<tool_call>{"name": "search", "arguments": {"query": "jax"}}</tool_call>\n'
            '<tool_call>{"name": "fetch", "arguments": "{\\"url\\": \\"x\\"}"}</tool_call>'
            '<tool_call>{"name": "now"}</tool_call>')
    parsed = parse_hermes(text)
    assert parsed.content == "Let me look."
    assert parsed.calls == (ToolCall("search", {"query": "jax"}), ToolCall("fetch", {"url": "x"}), ToolCall("now"))
    assert parsed.assistant_message()["tool_calls"][0] == {"type": "function", "function": {
        "name": "search", "arguments": {"query": "jax"}}}
    assert parse_hermes("The answer is 4.") == ParsedMessage("The answer is 4.")


def test_hermes_malformed_calls_say_what_was_wrong():
    parsed = parse_hermes('<tool_call>{"name": "multiply", "arguments": {"a": 3,}}</tool_call>'
                          '<tool_call>{"arguments": {}}</tool_call>'
                          '<tool_call>["multiply"]</tool_call>'
                          '<tool_call>{"name": "multiply", "arguments": [3, 4]}</tool_call>'
                          '<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 2}}</tool_call>'
                          '<tool_call>{"name": "search", "argu')
    bad = parsed.calls
    assert [type(c) for c in bad] == [MalformedCall] * 4 + [ToolCall, MalformedCall]
    assert bad[0].error.startswith("not valid JSON (")
    assert '"name" field' in bad[1].error
    assert "got a JSON array" in bad[2].error
    assert '"arguments" must be a JSON object' in bad[3].error and bad[3].name == "multiply"
    assert bad[4] == ToolCall("divide", {"a": 1, "b": 2})
    assert "not closed" in bad[5].error
    assert all("<tool_call>" in c.expected for c in bad if isinstance(c, MalformedCall))
    assert parsed.tool_calls == [bad[4]]


def test_llama3_json_calls():
    call = ToolCall("multiply", {"a": 3, "b": 4})
    assert parse_llama3('{"name": "multiply", "parameters": {"a": 3, "b": 4}}').calls == (call,)
    assert parse_llama3('<|python_tag|>{"name": "multiply", "parameters": {"a": 3, "b": 4}}<|eom_id|>').calls == (call,)
    two = parse_llama3('{"name": "multiply", "parameters": {"a": 3, "b": 4}}; {"name": "now", "parameters": {}}')
    assert two.calls == (call, ToolCall("now"))
    assert parse_llama3("It is 12.<|eot_id|>") == ParsedMessage("It is 12.<|eot_id|>")
    broken = parse_llama3('{"name": "multiply", "parameters": {"a": 3')
    assert isinstance(broken.calls[0], MalformedCall) and "not valid JSON" in broken.calls[0].error
    assert '"parameters"' in broken.calls[0].expected
    assert "not followed by a call" in parse_llama3("<|python_tag|>").calls[0].error
    wrong = parse_llama3('{"name": "multiply", "parameters": 3}').calls[0]
    assert isinstance(wrong, MalformedCall) and wrong.name == "multiply" and "got a JSON number" in wrong.error


def test_parser_registry(tmp_path, monkeypatch):
    assert get_tool_call_parser("hermes") is parse_hermes and get_tool_call_parser("llama3") is parse_llama3

    def shout(text):
        return ParsedMessage("", (ToolCall(text.strip("!")),)) if text.endswith("!") else ParsedMessage(text)

    register_tool_call_parser("shout_test", shout)
    assert get_tool_call_parser("shout_test")("now!").calls == (ToolCall("now"),)
    with pytest.raises(ValueError, match="already registered"):
        register_tool_call_parser("shout_test", parse_hermes)
    register_tool_call_parser("shout_test", parse_hermes, replace=True)
    assert "shout_test" in agents.tool_call_parser_names()
    with pytest.raises(ConfigError, match=r"'nope' is not registered; expected one of \[.*'hermes'"):
        get_tool_call_parser("nope")
    (tmp_path / "my_parsers_test.py").write_text("from ppojax.agents import parse_hermes as parse\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_tool_call_parser("my_parsers_test:parse") is parse_hermes
    assert load_tool_call_parser("llama3") is parse_llama3


# ------------------------------------------------------------------------------------------------- running calls
def test_failures_become_observations_and_are_counted():
    runner = ToolRunner(timeout=0.3)
    tools = agents.tool_table([multiply, divide, hang, fetch, hang_async])
    calls = parse_hermes('<tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}</tool_call>'
                         '<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 0}}</tool_call>'
                         '<tool_call>{"name": "hang", "arguments": {"seconds": 5}}</tool_call>'
                         '<tool_call>{"name": "fetch", "arguments": {"url": "a.b"}}</tool_call>'
                         '<tool_call>{"name": "hang_async", "arguments": {"seconds": 5}}</tool_call>'
                         '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
                         '<tool_call>{"name": "multiply", "arguments": {"c": 1}}</tool_call>'
                         '<tool_call>{"name": "multiply" "arguments": {}}</tool_call>').calls
    start = time.monotonic()
    results = runner.run(calls, tools)
    assert time.monotonic() - start < 2.0  # two 0.3 s timeouts, not two 5 s sleeps
    assert [r.status for r in results] == ["ok", "error", "timeout", "ok", "timeout", "error", "error", "malformed"]
    assert results[0].content == "12"
    assert results[1].content == "{'error': 'division by zero'}"  # TRL's text: str({"error": str(e)})
    assert results[2].content == "{'error': 'Tool hang timed out after 0.3 s.'}"
    assert results[3].content == "<html>a.b</html>"
    assert results[4].content == "{'error': 'Tool hang_async timed out after 0.3 s.'}"
    assert results[5].content == "{'error': 'Tool nope not found.'}"  # TRL's text
    assert "unexpected keyword argument 'c'" in results[6].content
    assert results[7].content.startswith("{'error': 'Malformed tool call: not valid JSON (")
    assert results[7].name == "unknown"
    assert results[0].message() == {"role": "tool", "name": "multiply", "content": "12"}
    counters = runner.counters
    assert (counters.calls, counters.errors, counters.timeouts, counters.malformed) == (8, 3, 2, 1)
    assert counters.metrics() == {"tools/calls": 8.0, "tools/errors": 3.0, "tools/timeouts": 2.0,
                                  "tools/malformed": 1.0}
    counters.reset()
    assert counters.calls == 0


def test_tool_parameters_named_like_the_runner_s_own():
    def clock(timeout: int, fn: str) -> str:
        """Echo.

        Args:
            timeout: A number.
            fn: A name.
        """
        return f"{timeout}/{fn}"

    assert ToolRunner(timeout=1).run([ToolCall("clock", {"timeout": 3, "fn": "x"})], {"clock": clock})[0].content \
        == "3/x"


def test_batch_runs_episodes_at_the_same_time_and_calls_in_order():
    order = []
    lock = threading.Lock()

    def step(episode: int, k: int) -> str:
        """Record.

        Args:
            episode: Which episode.
            k: Which call.
        """
        time.sleep(0.2)
        with lock:
            order.append((episode, k))
        return f"{episode}.{k}"

    batch = [[ToolCall("step", {"episode": e, "k": k}) for k in range(2)] for e in range(4)]
    start = time.monotonic()
    results = ToolRunner(timeout=2).run_batch(batch, {"step": step})
    assert time.monotonic() - start < 1.2  # 4 episodes x 2 calls x 0.2 s would be 1.6 s one after the other
    assert [[r.content for r in ep] for ep in results] == [[f"{e}.0", f"{e}.1"] for e in range(4)]
    for e in range(4):
        assert order.index((e, 0)) < order.index((e, 1))
    with pytest.raises(ConfigError, match="positive number of seconds"):
        ToolRunner(timeout=0)


# ------------------------------------------------------------------------------------------------- environments
def test_trl_style_environment_through_the_adapter():
    factory = EnvironmentFactory(Counter, tools=[multiply], max_tool_calling_iterations=2)
    assert factory.kind == "tools" and factory.owns_reward
    assert factory.tool_schemas == [EXPECTED["multiply"], EXPECTED["add"]]  # standalone tools, then the methods
    envs = factory.take(3)
    assert len(envs) == 3 and factory.take(2) == envs[:2]  # pooled: constructed once, reset for each episode
    env = envs[0]
    assert isinstance(env, ToolEnvironment) and sorted(env.tools) == ["add", "multiply"]
    assert reset_environment(env, {"prompt": "Count.", "target": 5}, 0) == " Reach 5."
    step = step_environment(env, '<tool_call>{"name": "add", "arguments": {"amount": 2}}</tool_call>'
                                 '<tool_call>{"name": "add", "arguments": {"amount": 3}}</tool_call>', 0)
    assert step == Step([{"role": "tool", "name": "add", "content": "total=2"},
                         {"role": "tool", "name": "add", "content": "total=5"}], None, False)
    assert env.last_message.assistant_message()["tool_calls"][1]["function"]["arguments"] == {"amount": 3}
    assert final_reward(env, 0) == 1.0
    assert step_environment(env, "Done: 5.", 0) == Step(None, None, True)  # no call: the episode ends
    # the tool-turn limit: the call after max_tool_calling_iterations tool turns is not run (TRL)
    reset_environment(env, {"target": 1}, 0)
    add = '<tool_call>{"name": "add", "arguments": {"amount": 1}}</tool_call>'
    assert not step_environment(env, add, 0).done and not step_environment(env, add, 0).done
    assert step_environment(env, add, 0) == Step(None, None, True) and env.instance.total == 2
    assert factory.runner.counters.calls == 4


def test_standalone_tools_without_an_environment():
    env = ToolEnvironment(tools=[multiply], parser="llama3")
    assert reset_environment(env, {"prompt": "x"}, 0) is None
    step = step_environment(env, '{"name": "multiply", "parameters": {"a": 2, "b": 5}}', 0)
    assert step.observation == [{"role": "tool", "name": "multiply", "content": "10"}] and not step.done
    assert final_reward(env, 0) is None


class Guess(Environment):
    """The protocol, async: guess the row's number; a reward per turn."""

    async def reset(self, answer: int, **row) -> Optional[str]:
        await asyncio.sleep(0)
        self.answer, self.turns = answer, 0
        return None

    async def step(self, action: str) -> Step:
        await asyncio.sleep(0.2)
        self.turns += 1
        guess = int(action)
        if guess == self.answer:
            return Step(None, 1.0, True)
        return Step("higher" if guess < self.answer else "lower", -0.1, self.turns >= 3)


def test_async_protocol_environment():
    factory = EnvironmentFactory(Guess)
    assert factory.kind == "protocol" and factory.tool_schemas == [] and not factory.owns_reward
    envs = factory.take(4)
    assert agents.reset_all(envs, [{"answer": a, "prompt": "?"} for a in range(4)], list(range(4))) == [None] * 4
    start = time.monotonic()
    steps = step_all(envs, ["1", "1", "1", "1"], list(range(4)))
    assert time.monotonic() - start < 0.7  # four 0.2 s steps at the same time
    assert steps == [Step("lower", -0.1, False), Step(None, 1.0, True), Step("higher", -0.1, False),
                     Step("higher", -0.1, False)]
    assert final_reward(envs[0], 0) is None


def test_environment_errors_stop_the_run_naming_class_method_and_row():
    class Broken(Environment):
        def reset(self, **row):
            if row.get("bad"):
                raise KeyError("level")
            return 7

        def step(self, action):
            if action == "raise":
                raise RuntimeError("server gone")
            return {"observation": "x"} if action == "dict" else ("ok", float("nan"), False)

        def get_reward(self):
            return "high"

    env = Broken()
    with pytest.raises(EnvironmentCallError, match=r"environment Broken\.reset raised KeyError: 'level' on row 7"):
        reset_environment(env, {"bad": True}, 7)
    with pytest.raises(EnvironmentCallError,
                       match=r"Broken\.reset returned 7 \(of type int\) on row 2; expected None or a string"):
        reset_environment(env, {}, 2)
    guess = Guess()
    reset_environment(guess, {"answer": 1}, 1)
    with pytest.raises(EnvironmentCallError, match=r"Broken\.step raised RuntimeError: server gone on row 3"):
        step_all([guess, env], ["1", "raise"], [1, 3])
    with pytest.raises(EnvironmentCallError, match=r"Broken\.step returned .* on row 4.*\(observation, reward, done\)"):
        step_environment(env, "dict", 4)
    with pytest.raises(EnvironmentCallError, match=r"Broken\.step returned reward nan on row 5"):
        step_environment(env, "fine", 5)
    with pytest.raises(EnvironmentCallError, match=r"Broken\.get_reward returned 'high' on row 6"):
        final_reward(env, 6)

    class ResetFails(Counter):
        def reset(self, **row):
            raise ValueError("no such level")

    adapted = EnvironmentFactory(ResetFails).take(1)[0]
    with pytest.raises(EnvironmentCallError, match=r"environment ResetFails\.reset raised ValueError: no such level "
                                                   r"on row 11"):
        reset_environment(adapted, {"prompt": "p"}, 11)


def test_environment_refusals():
    class NoReset:
        def add(self, amount: int) -> str:
            """Add.

            Args:
                amount: How much.
            """

    with pytest.raises(ConfigError, match="environment .*NoReset has no reset method.*Fix:"):
        EnvironmentFactory(NoReset)

    class Undocumented(Counter):
        def look(self, where):
            return where

    with pytest.raises(ConfigError, match=r"environment .*Undocumented's tool .*look cannot be described.*Fix:"):
        EnvironmentFactory(Undocumented)

    class HalfProtocol(Environment):
        def reset(self, **row):
            return None

    with pytest.raises(ConfigError, match="does not implement both reset"):
        EnvironmentFactory(HalfProtocol)
    with pytest.raises(ConfigError, match="tools are offered only with TRL-style environments"):
        EnvironmentFactory(Guess, tools=[multiply])

    class Clashes(Counter):
        def multiply(self, a: int) -> int:
            """Twice.

            Args:
                a: A.
            """
            return 2 * a

    with pytest.raises(ConfigError, match="two tools are named 'multiply'"):
        EnvironmentFactory(Clashes, tools=[multiply])

    def needs_arguments(size):
        return Counter()

    with pytest.raises(EnvironmentCallError, match="needs_arguments.*raised TypeError"):
        EnvironmentFactory(needs_arguments)


# ------------------------------------------------------------------------------------------------------ loading
def test_loading_module_names(tmp_path, monkeypatch):
    (tmp_path / "agent_things_test.py").write_text(textwrap.dedent('''
        def lookup(word: str) -> str:
            """Look a word up.

            Args:
                word: The word.
            """
            return word.upper()

        def bare(word):
            return word

        class Shop:
            def reset(self, **row):
                return None

            def buy(self, item: str) -> str:
                """Buy an item.

                Args:
                    item: What to buy.
                """
                return "bought " + item

        NOT_A_TOOL = 3
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    tools = load_tools(["agent_things_test:lookup", multiply])
    assert [t.__name__ for t in tools] == ["lookup", "multiply"] and load_tools(None) == []
    with pytest.raises(ConfigError, match="agent_things_test.bare cannot be described.*no docstring\\. Fix"):
        load_tools(["agent_things_test:bare"])
    with pytest.raises(ConfigError, match="tool 'agent_things_test:missing': module 'agent_things_test' has no"):
        load_tools(["agent_things_test:missing"])
    with pytest.raises(ConfigError, match="tool 'no_module_xyz:f' could not be imported"):
        load_tools(["no_module_xyz:f"])
    with pytest.raises(ConfigError, match="expected 'module:name'"):
        load_tools(["lookup"])
    with pytest.raises(ConfigError,
                       match=r"tool 'agent_things_test:NOT_A_TOOL' is not a function \(it is 3, of type int\)"):
        load_tools(["agent_things_test:NOT_A_TOOL"])
    factory = load_environment("agent_things_test:Shop", tools=["agent_things_test:lookup"], parser="hermes",
                               tool_timeout=1.0, max_tool_calling_iterations=4)
    assert factory.label == "agent_things_test:Shop" and factory.kind == "tools"
    assert [s["function"]["name"] for s in factory.tool_schemas] == ["lookup", "buy"]
    env = factory.take(1)[0]
    step = step_environment(env, '<tool_call>{"name": "buy", "arguments": {"item": "tea"}}</tool_call>', 0)
    assert step.observation[0]["content"] == "bought tea"
    with pytest.raises(ConfigError, match="max_tool_calling_iterations=-1"):
        load_environment("agent_things_test:Shop", max_tool_calling_iterations=-1)
    with pytest.raises(ConfigError, match="tool-call parser 'qwen9' is not registered"):
        load_environment("agent_things_test:Shop", parser="qwen9")


# ------------------------------------------------------------------------------------------------ chat template
@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from ppojax.assets import smollm2_checkpoint

    return AutoTokenizer.from_pretrained(str(smollm2_checkpoint(log=lambda *a, **k: None)))


def test_smollm2_bundled_template_drops_tools_and_is_refused(smollm2_tokenizer):
    tok = smollm2_tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=[multiply], tokenize=False)
    assert "multiply" not in text  # SmolLM2-135M-Instruct's own template ignores tools
    assert not supports_tool_calling(tok)
    with pytest.raises(ConfigError, match="does not render tool calls.*CHATML_TOOLS_TEMPLATE"):
        check_tool_template(tok, model="SmolLM2")
    assert supports_tool_calling(tok, CHATML_TOOLS_TEMPLATE)
    check_tool_template(tok, CHATML_TOOLS_TEMPLATE)


def test_tools_rendered_by_the_chatml_template(smollm2_tokenizer):
    tok = smollm2_tokenizer
    chat = [{"role": "user", "content": "What is 3 times 4?"}]
    plain = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True,
                                   chat_template=CHATML_TOOLS_TEMPLATE) == plain  # no tools: SmolLM2's own text
    text = tok.apply_chat_template(chat, tools=[multiply, search], tokenize=False, add_generation_prompt=True,
                                   chat_template=CHATML_TOOLS_TEMPLATE)
    for name in ("multiply", "search"):  # the schema text, as the template's tojson writes it
        assert json.dumps(EXPECTED[name]) in text
    assert text.endswith("<|im_start|>user\nWhat is 3 times 4?<|im_end|>\n<|im_start|>assistant\n")

    # a whole exchange: the rendered call parses back; appending messages keeps the earlier text (prefix-preserving)
    env = ToolEnvironment(tools=[multiply])
    reply = '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
    step = step_environment(env, reply, 0)
    turn = chat + [env.last_message.assistant_message()]
    with_call = tok.apply_chat_template(turn, tools=[multiply], tokenize=False, chat_template=CHATML_TOOLS_TEMPLATE)
    assert with_call.endswith("<|im_start|>assistant\n" + reply + "<|im_end|>\n")
    full = tok.apply_chat_template(turn + step.observation, tools=[multiply], tokenize=False,
                                   add_generation_prompt=True, chat_template=CHATML_TOOLS_TEMPLATE)
    assert full == with_call + "<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n" \
        "<|im_start|>assistant\n"


def test_arithmetic_tools_prompts_open_with_worked_calculator_calls(smollm2_tokenizer):
    """The built-in dataset `arithmetic_tools`: the problems of `arithmetic` (the same questions and answers), each
    prompt a conversation opening with worked problems. Rendered by the ChatML tools template, every worked call
    parses back (hermes) to `calculate` with an expression whose value by Python's own arithmetic is the tool's
    answer and the number after '####' in the assistant's final answer."""
    def records(name):
        return [json.loads(line) for line in arithmetic_split(name, log=lambda *a: None).read_text().splitlines()]

    plain, worked = records("arithmetic:test"), records("arithmetic_tools:test")
    assert len(worked) == len(plain) == 200
    assert [r["answer"] for r in worked] == [r["answer"] for r in plain]
    assert all(w["prompt"][-1] == {"role": "user", "content": p["prompt"]} for w, p in zip(worked, plain))
    assert all(w["prompt"][:-1] == worked[0]["prompt"][:-1] for w in worked)  # the same worked problems each time

    text = smollm2_tokenizer.apply_chat_template(worked[0]["prompt"], tools=[calculate], tokenize=False,
                                                 add_generation_prompt=True, chat_template=CHATML_TOOLS_TEMPLATE)
    assert text.endswith(plain[0]["prompt"] + "<|im_end|>\n<|im_start|>assistant\n")
    turns = [t.split("<|im_end|>")[0] for t in text.split("<|im_start|>")[2:-2]]  # after the system message
    assert [t.split("\n")[0] for t in turns] == ["user", "assistant", "user", "assistant"] * 2  # tool answers: user
    for call_turn, answer_turn, final_turn in zip(turns[1::4], turns[2::4], turns[3::4]):
        (call,) = parse_hermes(call_turn.removeprefix("assistant")).calls
        assert call.name == "calculate" and set(call.arguments) == {"expression"}
        value = eval(call.arguments["expression"], {"__builtins__": {}})  # plain Python arithmetic
        assert answer_turn == f"user\n<tool_response>\n{value}\n</tool_response>"
        assert final_turn.endswith(f"\n#### {value}")
