"""The stand-ins for model APIs live in the SDK (`locker.testing`), where the example's
offline mode finds them too; the tests import them from here as before."""

from locker.testing import MessagesStandIn, Scripted, anthropic_turn, endless, text, tool_use  # noqa: F401
