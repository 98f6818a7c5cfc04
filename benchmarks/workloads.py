"""Fixed, deterministic prompts for the benchmarks: no randomness, same tokens every run."""

from __future__ import annotations

from typing import Any

# Different user questions: through the chat template (which adds the model's default system
# prompt) each prompt is about 30-60 tokens.
QUESTIONS: tuple[str, ...] = (
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "How do I reverse a list in Python?",
    "Why is the sky blue during the day but red at sunset?",
    "Give me three tips for sleeping better.",
    "What is the difference between a virus and a bacterium?",
    "Write a haiku about autumn leaves falling in a quiet park.",
    "How many planets are in the solar system, and which is the largest?",
    "What does HTTP stand for?",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "How does a refrigerator keep food cold?",
    "What are the main causes of inflation in an economy?",
    "Translate 'good morning, how are you?' into Spanish.",
    "What is a prime number? Give two examples.",
    "Suggest a name for a small bakery that sells sourdough bread.",
    "How do vaccines train the immune system?",
    "What is the boiling point of water at the top of a high mountain?",
    "Explain recursion to a ten year old.",
    "List four renewable sources of energy.",
    "What is the tallest mountain on Earth?",
    "How can I improve my handwriting?",
    "Why do cats purr?",
    "Describe the water cycle step by step.",
    "What is the Pythagorean theorem used for in everyday life?",
    "How do I make a cup of green tea properly?",
    "What is machine learning, in simple words?",
    "Which is heavier, a kilogram of feathers or a kilogram of iron?",
    "Give me a short motivational quote for a Monday morning.",
    "How does a bicycle stay upright while moving?",
    "What is the difference between weather and climate?",
    "Write a two-line poem about the ocean.",
    "Why do we have leap years?",
    "Explain what a black hole is.",
    "How should I prepare for a job interview at a software company?",
    "What are the primary colors of light?",
    "How do bees make honey?",
    "What is the speed of sound in air?",
    "Recommend a good habit for learning a new language every day.",
    "What causes earthquakes?",
    "How do I calculate the area of a circle with a radius of 3 meters?",
    "What is the role of the heart in the human body?",
    "Name three famous paintings and their painters.",
    "Why does ice float on water?",
    "What is a healthy breakfast that takes less than five minutes to prepare?",
    "Explain the difference between RAM and disk storage.",
    "How do airplanes fly?",
    "What is the largest ocean on the planet?",
    "Give me a simple recipe for pancakes.",
    "What are the benefits of regular exercise for the brain?",
    "Describe a rainbow to someone who has never seen one.",
    "How does the internet send a message from one computer to another?",
    "What is the meaning of the word 'ephemeral'?",
    "Why do leaves change color in the fall?",
    "How long does it take light from the Sun to reach the Earth?",
    "What is an API, and why do programmers use them?",
    "Suggest a weekend activity for a family with two young children.",
    "How do magnets work?",
    "What is the difference between a lake and a pond?",
    "Explain supply and demand with an example about apples.",
    "What should I pack for a three-day hiking trip?",
    "Who invented the telephone?",
    "How do I stay focused while studying for exams?",
    "What is the chemical formula of table salt?",
    "Write a friendly one-sentence greeting for a new neighbor.",
    "Why is it important to drink enough water?",
    "How does a compass find north?",
    "What are clouds made of?",
    "Give two reasons why people keep dogs as pets.",
    "What is a sorting algorithm? Name one.",
    "How do solar panels turn sunlight into electricity?",
    "What is the smallest unit of life?",
    "Explain why the Moon has phases.",
)

# Sentences of a long, fixed system prompt; repeated in order until the token target is met.
_SYSTEM_SENTENCES: tuple[str, ...] = (
    "You are the support assistant of Northwind Outfitters, a shop for outdoor gear.",
    "Answer politely, in plain English, and keep every answer under one hundred words.",
    "Our stores open from nine in the morning to seven in the evening, Monday to Saturday.",
    "Customers may return unused items within thirty days with the original receipt.",
    "Items bought on sale can be exchanged but not refunded.",
    "Shipping is free for orders above fifty dollars inside the country.",
    "International orders ship within five business days and customs fees are the buyer's.",
    "Tents carry a two-year warranty against manufacturing defects, not against misuse.",
    "Sleeping bags are rated by comfort temperature; always quote the comfort rating.",
    "Never promise a delivery date; give the usual range and point to the tracking page.",
    "If a customer reports an injury, apologise and ask them to call the safety line.",
    "Do not give medical advice; recommend a doctor for anything about health.",
    "Loyalty members earn one point per dollar and can redeem one hundred points for five.",
    "Gift cards never expire and can be used online and in stores.",
    "Price matching applies to identical items sold by a local competitor the same week.",
    "Rental equipment must be returned clean; cleaning fees start at fifteen dollars.",
    "Kayak rentals need a signed waiver and a life jacket for every passenger.",
    "Climbing ropes are not returnable once the packaging has been opened, for safety.",
    "Boots can be resoled in our workshop in about three weeks.",
    "When you do not know an answer, say so and offer to connect the customer to a human.",
)


def chat_prompt(tokenizer: Any, user: str, system: str | None = None) -> list[int]:
    """Token ids of one user turn through the model's chat template, ready to generate."""
    messages = [{"role": "user", "content": user}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def question(i: int) -> str:
    """The i-th question; past the list, numbered variants keep every prompt unique."""
    q = QUESTIONS[i % len(QUESTIONS)]
    return q if i < len(QUESTIONS) else f"{q} (variant {i // len(QUESTIONS)})"


def unique_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    """n different user questions, each through the chat template (default system prompt)."""
    return [chat_prompt(tokenizer, question(i)) for i in range(n)]


def system_prompt(tokenizer: Any, target_tokens: int) -> str:
    """A fixed system prompt of about target_tokens tokens (whole sentences, never fewer)."""
    parts: list[str] = []
    i = 0
    while len(tokenizer.encode(" ".join(parts))) < target_tokens:
        parts.append(_SYSTEM_SENTENCES[i % len(_SYSTEM_SENTENCES)])
        i += 1
    return " ".join(parts)


def shared_prompts(tokenizer: Any, n: int, system_tokens: int) -> list[list[int]]:
    """n prompts with one common system prompt of ~system_tokens tokens and different users."""
    system = system_prompt(tokenizer, system_tokens)
    return [chat_prompt(tokenizer, question(i), system=system) for i in range(n)]


def length_summary(prompts: list[list[int]]) -> str:
    lens = [len(p) for p in prompts]
    return f"{min(lens)}-{max(lens)} tokens (mean {sum(lens) / len(lens):.0f})"
