"""Agent features: the agent (tool-use) benchmark. The tool-call wire format is in clover.chat, the
local toolbox and its seeded dialogues in clover.data.toolbox."""
