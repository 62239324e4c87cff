"""Fixed prompts shared by the tests (12 chat, 12 raw)."""

QUESTIONS = [
    "What is 2+2?", "Name three primary colors.", "Write a haiku about the sea.",
    "What is the capital of Japan?", "Explain gravity in one sentence.", "List two fruits.",
    "How many legs does a spider have?", "What is the boiling point of water?",
    "Give me a synonym for happy.", "Who wrote Romeo and Juliet?", "What is 7 times 8?",
    "Translate 'hello' into French.",
]
RAW = [
    "The capital of France is", "Once upon a time", "def fibonacci(n):", "The three laws of motion are",
    "In 1492, Columbus", "The quick brown fox", "Water is made of", "My favourite food is",
    "import numpy as np\n", "The sun rises in the", "A list of prime numbers: 2, 3, 5,", "Dear Sir or Madam,",
]
CHATS = [[{"role": "user", "content": q}] for q in QUESTIONS]
PROMPTS = CHATS + RAW
