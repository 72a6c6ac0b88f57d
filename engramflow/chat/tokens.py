"""V4.1's special tokens and fixed texts of its chat format.

The strings use the fullwidth bar (U+FF5C) and the lower one-eighth block (U+2581) exactly as
the released tokenizer spells them: each of the `SPECIAL` tokens is one id there.
"""
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
THINK_START = "<think>"
THINK_END = "</think>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SYSTEM = "<｜System｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
IMAGE = "<｜deepseek_image｜>"
DSML = "｜DSML｜"

# tool-call markup: a "calls" block of "invoke"s of "parameter"s (the tag names start with a space)
CALLS_OPEN = f"<{DSML} calls>"
CALLS_CLOSE = f"</{DSML} calls>"
INVOKE_OPEN = f"<{DSML} invoke"
INVOKE_CLOSE = f"</{DSML} invoke>"
PARAM_OPEN = f"<{DSML} parameter"
PARAM_CLOSE = f"</{DSML} parameter>"
CALLS_START = "\n\n" + CALLS_OPEN  # how a completion's tool-call block begins

SPECIAL = [BOS, EOS, THINK_START, THINK_END, USER, ASSISTANT, SYSTEM, LATEST_REMINDER, IMAGE]

EFFORT_LEVELS = {"low": 25, "high": 50, "xhigh": 75, "max": 100}
DEFAULT_EFFORT = "high"
EFFORT_TEXT = ("Reasoning Effort: {budget} "
               "(range 1-100, the higher the value, the more thorough the reasoning)\n\n")
RESPONSE_FORMAT_TEXT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"

TOOLS_TEXT = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "{CALLS_OPEN}" block like the following:

{CALLS_OPEN}
{INVOKE_OPEN} name="$TOOL_NAME">
{PARAM_OPEN} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAM_CLOSE}
...
{INVOKE_CLOSE}
{INVOKE_OPEN} name="$TOOL_NAME2">
...
{INVOKE_CLOSE}
{CALLS_CLOSE}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""
