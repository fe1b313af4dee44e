"""Structured output: grammars compiled beside the engine loop, one matcher per engine
request, and the token bitmask the sampler applies (the grammar step of the logits
pipeline: penalties -> logit bias -> grammar mask -> temperature -> top-k/p -> sample).

    grammar_compiler.py   StructuredOutputParams -> CompiledGrammar, on a thread pool, cached
    request_grammar.py    a request's matcher: accept tokens, fill its bitmask row
    bitmask.py            applying bitmask rows to logits (torch only; no xgrammar needed)
"""
